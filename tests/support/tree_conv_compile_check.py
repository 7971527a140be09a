"""Compile the Gated DeltaNet layers' Triton kernels (the path convolution, `asyncgrpo.packing.tree_conv`,
and the gated RMS norm, `asyncgrpo.packing.gated_norm`) for a Hopper GPU (sm_90, the H100/H200)
through Triton's whole pipeline down to machine code, on a machine without a GPU: Triton's interpreter
runs a kernel's logic but skips the compiler, whose layout passes once rejected a kernel that the
interpreter ran correctly. Run by tests/unit/test_gated_deltanet.py in a process of its own, without
TRITON_INTERPRET; prints one line per kernel and variant, with its registers, stack (spills) and
shared memory.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from asyncgrpo.packing import gated_norm, tree_conv

HOPPER = GPUTarget("cuda", 90, 32)
KERNEL_SIZE = 4  # Qwen3.5's and Qwen3-Next's conv_kernel_size
HEAD_DIM = 128  # Qwen3.5's and Qwen3-Next's linear_value_head_dim
# Arguments Triton's launcher finds divisible by 16 at the Qwen3.5-2B shape (it specializes on that at
# each launch, and vectorizes loads on it): every pointer (torch's allocations, and the layer's
# column slices start at multiples of 16 columns), channels, strides, q/k/v widths, heads.
DIVISIBLE = {"channels", "x_stride", "w0", "w1", "heads", "z_stride_token", "z_stride_head"}


def conv_kernels(x: str, has_bias: bool, even: bool) -> dict:
    """Each path-convolution kernel's argument types as the autograd function launches it, at the
    tiles it launches: x, the outputs and their gradients in x's dtype, the weight and bias fp32
    (autocast keeps parameters in fp32), index tensors int64, slots int32; `even`: q, k and v widths
    multiples of the tile's channels (Qwen3.5's), no column masks."""
    sizes = {"num_rows": "i32", "channels": "i32", "x_stride": "i32", "w0": "i32", "w1": "i32"}
    conv = {"x_ptr": x, "w_ptr": "*fp32", "b_ptr": "*fp32", "index_ptr": "*i64"}
    forward, backward = tree_conv.FORWARD_TILE, tree_conv.BACKWARD_TILE
    return {
        "conv forward": (tree_conv._forward_kernel, forward.warps,
                         {**conv, "out0_ptr": x, "out1_ptr": x, "out2_ptr": x, **sizes},
                         {"HAS_BIAS": has_bias, "K": KERNEL_SIZE, "BLOCK_R": forward.rows,
                          "BLOCK_C": forward.channels, "EVEN": even}),
        "conv backward": (tree_conv._backward_kernel, backward.warps,
                          {**conv, "dy0_ptr": x, "dy1_ptr": x, "dy2_ptr": x, "dx_ptr": x,
                           "partial_w_ptr": "*fp32", "partial_b_ptr": "*fp32", "read_slot_ptr": "*i32",
                           "reader_grad_ptr": "*fp32", "remote_slot_ptr": "*i32",
                           "remote_local_ptr": "*fp32", **sizes},
                          {"HAS_BIAS": has_bias, "K": KERNEL_SIZE, "BLOCK_R": backward.rows,
                           "BLOCK_C": backward.channels, "EVEN": even}),
        "conv remote reads": (tree_conv._remote_kernel, 4,
                              {"w_ptr": "*fp32", "reader_grad_ptr": "*fp32", "remote_local_ptr": "*fp32",
                               "remote_tokens_ptr": "*i64", "offsets_ptr": "*i64", "entries_ptr": "*i64",
                               "dx_ptr": x, "channels": "i32"},
                              {"K": KERNEL_SIZE, "BLOCK_C": tree_conv.REMOTE_CHANNELS}),
    }  # fmt: skip


def norm_kernels(x: str) -> dict:
    """The gated norm's kernels: x, the gate and every gradient in x's dtype, the weight fp32."""
    sizes = {
        "num_rows": "i32",
        "heads": "i32",
        "z_stride_token": "i32",
        "z_stride_head": "i32",
        "eps": "fp32",
    }
    blocks = {"D": HEAD_DIM, "BLOCK_R": gated_norm.BLOCK_ROWS, "BLOCK_D": HEAD_DIM}
    return {
        "norm forward": (gated_norm._forward_kernel, gated_norm.FORWARD_WARPS,
                         {"x_ptr": x, "z_ptr": x, "w_ptr": "*fp32", "out_ptr": x, **sizes}, blocks),
        "norm backward": (gated_norm._backward_kernel, gated_norm.BACKWARD_WARPS,
                          {"x_ptr": x, "z_ptr": x, "w_ptr": "*fp32", "grad_out_ptr": x, "grad_x_ptr": x,
                           "grad_z_ptr": x, "partial_w_ptr": "*fp32", **sizes}, blocks),
    }  # fmt: skip


def variants():
    for (x, even), has_bias in itertools.product([("*bf16", True), ("*fp32", False)], [False, True]):
        for name, kernel in conv_kernels(x, has_bias, even).items():
            yield f"{name} x={x} bias={has_bias} even={even}", kernel
    for x in ["*bf16", "*fp32"]:
        for name, kernel in norm_kernels(x).items():
            yield f"{name} x={x}", kernel


def resource_usage(cubin: bytes) -> str:
    """Registers, spill stores and loads, and shared memory per program, as Triton's cuobjdump reads
    them off the machine code (no GPU needed)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(path)],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    found = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return " ".join(f"{name.lower()}={found.get(name)}" for name in ("REG", "STACK", "SHARED", "LOCAL"))


def compile_for_hopper(kernel, warps: int, types: dict, constants: dict):
    """`kernel` compiled for sm_90 with these argument types and constants, as Triton's launcher would
    specialize it at the Qwen3.5-2B shape."""
    types = {**types, **{constant: "constexpr" for constant in constants}}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in types.items()
             if kind.startswith("*") or name in DIVISIBLE}  # fmt: skip
    source = ASTSource(fn=kernel, signature=types, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=HOPPER, options={"num_warps": warps})


def main() -> None:
    for label, (kernel, warps, types, constants) in variants():
        compiled = compile_for_hopper(kernel, warps, types, constants)
        assert compiled.asm.get("cubin"), f"{label}: no machine code"
        print(f"compiled {label} {resource_usage(compiled.asm['cubin'])}", flush=True)


if __name__ == "__main__":
    main()
