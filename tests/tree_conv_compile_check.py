"""Compile the Triton path-convolution kernels (`asyncgrpo.packing.tree_conv`) for a Hopper GPU
(sm_90, the H100/H200) through Triton's whole pipeline down to machine code, on a machine without a
GPU: Triton's interpreter runs a kernel's logic but skips the compiler, whose layout passes once
rejected a kernel that the interpreter ran correctly. Run by tests/test_gated_deltanet.py in a process
of its own, without TRITON_INTERPRET; prints one line per kernel and variant.
"""

from __future__ import annotations

import itertools

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from asyncgrpo.packing import tree_conv

HOPPER = GPUTarget("cuda", 90, 32)
KERNEL_SIZE = 4  # Qwen3.5's and Qwen3-Next's conv_kernel_size


def signatures(x: str, has_bias: bool) -> dict:
    """Each kernel's argument types as the autograd function launches it: x and the output in x's
    dtype, the weight and bias fp32 (autocast keeps parameters in fp32), index tensors int64."""
    blocks = {"K": KERNEL_SIZE, "BLOCK_R": tree_conv.BLOCK_ROWS, "BLOCK_C": tree_conv.BLOCK_CHANNELS}
    sizes = {"num_rows": "i32", "channels": "i32"}
    conv = {"x_ptr": x, "w_ptr": "*fp32", "b_ptr": "*fp32", "index_ptr": "*i64"}
    return {
        "forward": (tree_conv._forward_kernel, {**conv, "out_ptr": x, **sizes, "x_stride": "i32"},
                    {"HAS_BIAS": has_bias, **blocks}),
        "backward_rows": (tree_conv._backward_rows_kernel,
                          {**conv, "grad_out_ptr": x, "grad_pre_ptr": "*fp32", "partial_w_ptr": "*fp32",
                           "partial_b_ptr": "*fp32", **sizes, "x_stride": "i32"},
                          {"HAS_BIAS": has_bias, **blocks}),
        "backward_tokens": (tree_conv._backward_tokens_kernel,
                            {"w_ptr": "*fp32", "grad_pre_ptr": "*fp32", "offsets_ptr": "*i64",
                             "successors_ptr": "*i64", "grad_x_ptr": x, **sizes}, blocks),
    }  # fmt: skip


def main() -> None:
    for x, has_bias in itertools.product(["*bf16", "*fp32"], [False, True]):
        for name, (kernel, types, constants) in signatures(x, has_bias).items():
            for constant in constants:
                types[constant] = "constexpr"
            compiled = triton.compile(
                ASTSource(fn=kernel, signature=types, constexprs=constants), target=HOPPER
            )
            assert compiled.asm.get("cubin"), f"{name}: no machine code"
            print(f"compiled {name} x={x} bias={has_bias}")


if __name__ == "__main__":
    main()
