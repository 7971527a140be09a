"""Compile the tree-attention kernels (`asyncgrpo.packing.tree_attention_kernel`) for a Hopper GPU (sm_90)
down to machine code on a machine without a GPU, at the tiles `choose_config` picks for the models
the benchmarks train in bf16 (Qwen3: head dim 128, 2 query heads a key head; Qwen3.5: 256, 4), as
Triton's launcher would specialize them there (Qwen3-MoE's 128 and 8 take Qwen3's tiles; fp32, a
test-only path, takes small tiles whose spills are accepted). Triton's interpreter
(tests/support/tree_attention_kernel_check.py) runs the kernels' logic but not the compiler. Run by
tests/unit/test_tree_attention.py in a process of its own, without TRITON_INTERPRET; prints one line per
kernel and variant with its registers, stack (spills) and shared memory.
"""

from __future__ import annotations

import re

import torch
import triton
from tree_conv_compile_check import HOPPER, resource_usage
from triton.compiler import ASTSource

from asyncgrpo.packing import tree_attention_kernel as kernels

# (head dim, query heads, key/value heads) of the shapes the benchmarks train
SHAPES = {"qwen3": (128, 16, 8), "qwen3_5": (256, 8, 2)}
# Bytes of registers spilled that are accepted: 64 keys of dK and dV at head dim 256 fill the registers.
SPILL_ALLOWED = {("qwen3_5", "dk dv"): 64}
HOPPER_SHARED_MEMORY = 232_448  # bytes a program may take on sm_90 (227 KiB)
STRIDES = ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ot",
           "stride_oh", "stride_dt", "stride_dh", "stride_gt", "stride_gh", "stride_gkt", "stride_gkh",
           "stride_gvt", "stride_gvh")  # fmt: skip


def kernel_variants(head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype):
    """(name, kernel, warps, stages, argument types, constants) of each kernel as the autograd
    function launches it."""
    x = "*bf16" if dtype == torch.bfloat16 else "*fp32"
    groups = heads // kv_heads
    config = kernels.choose_config(head_dim, groups, dtype)
    common = {"G": groups, "D": head_dim, "BLOCK_D": kernels.block_dim(head_dim),
              "PRECISION": "ieee" if dtype == torch.float32 else None}  # fmt: skip
    types = {"q_ptr": x, "k_ptr": x, "v_ptr": x, "dout_ptr": x, "lse_ptr": "*fp32", "delta_ptr": "*fp32",
             "out_ptr": x, "dk_ptr": x, "dv_ptr": x, "tiles_ptr": "*i32", "ranges_ptr": "*i32",
             **{name: "i32" for name in STRIDES}, "num_heads": "i32", "num_kv_heads": "i32",
             "qk_scale": "fp32", "out_scale": "fp32", "scale": "fp32"}  # fmt: skip
    queries = {**common, "BLOCK_M": config.query_rows, "BLOCK_N": config.key_block}
    for name, backward in (("forward", False), ("dq", True)):
        yield (name, kernels._tree_attention_queries, config.forward_warps, config.forward_stages, types,
               {**queries, "BACKWARD": backward})  # fmt: skip
    yield ("dk dv", kernels._tree_attention_keys, config.backward_warps, config.backward_stages, types,
           {**common, "BLOCK_N": config.key_rows, "BLOCK_M": config.backward_query_rows})  # fmt: skip


def compile_for_hopper(kernel, warps: int, stages: int, types: dict, constants: dict):
    names = kernel.arg_names
    types = {name: kind for name, kind in types.items() if name in names}
    types.update({constant: "constexpr" for constant in constants})
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name, kind in types.items()
             if kind.startswith("*") or name.startswith("stride")}  # fmt: skip
    source = ASTSource(fn=kernel, signature=types, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=HOPPER, options={"num_warps": warps, "num_stages": stages})


def main() -> None:
    for model, shape in SHAPES.items():
        for name, kernel, warps, stages, types, constants in kernel_variants(*shape, torch.bfloat16):
            compiled = compile_for_hopper(kernel, warps, stages, types, constants)
            assert compiled.asm.get("cubin"), f"{model} {name}: no machine code"
            usage = resource_usage(compiled.asm["cubin"])
            shared = compiled.metadata.shared
            wgmma = len(re.findall(r"wgmma.mma_async", compiled.asm.get("ptx", "")))
            print(f"compiled {model} {name} {usage} triton_shared={shared} wgmma={wgmma}", flush=True)
            assert shared <= HOPPER_SHARED_MEMORY, f"{model} {name}: {shared} bytes of shared memory"
            assert wgmma, f"{model} {name}: no Hopper matrix instructions (wgmma)"
            spilled = int(re.search(r"stack=(\d+)", usage).group(1))
            assert spilled <= SPILL_ALLOWED.get((model, name), 0), f"{model} {name} spills: {usage}"


if __name__ == "__main__":
    main()
