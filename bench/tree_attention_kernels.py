"""Part benchmark: tree attention alone (one Qwen3-1.7B layer's attention, forward + backward) on one
step's rows of bench/gpu_step.py, tree-packed vs plain padding-free, for flex attention per set of
FlexAttention kernel options (tile shapes, TMA) and for asyncgrpo's own kernels per tile shape
(`--ours`: asyncgrpo.packing.tree_attention_kernel's configs).

Why: in the whole step, attention is where tree rows gain least over plain rows, and flex's backward
over the tree's block mask bounded the Qwen3 step (bench/RESULTS.md). This measures (a) whether tree
attention is as efficient per attended (query, key) pair as plain attention: the
`speedup_over_pair_ratio` it prints is 1.0 when it is; (b) which kernel and options are fastest on
this GPU, on the shared-prefix rows and on the default step's DeepMath-like rows (`--rows`), with
the attended pairs' TFLOP/s (4 x pairs x head dim x query heads forward, 2.5 times that backward);
(c) that our kernels agree with flex on these rows (largest difference of output and gradients).

Run (GPU machine): `python bench/tree_attention_kernels.py`; `--smoke` runs tiny shapes on CPU
(forward only, torch's defaults only: flex has no CPU backward).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_step import deepmath_plans, plain_rows_within_budget, shared_prefix_samples  # noqa: E402
from gpu_training import require_cuda  # noqa: E402

from asyncgrpo.packing import tree_attention as tree_attention_module  # noqa: E402
from asyncgrpo.packing.planner import TokenBudgetBatcher  # noqa: E402
from asyncgrpo.packing.tree_attention import (  # noqa: E402
    BLOCK_SIZE,
    build_tree_block_mask,
    padded_length,
    tree_attention,
    tree_layout,
)

QWEN3_1_7B_HEADS = (16, 8, 128)  # query heads, key/value heads, head dim
# name -> FlexAttention kernel options; torch's defaults on an H100/H200 (bf16, head dim 128):
# forward 128 x 64 tiles, 3 stages, 8 warps; backward 64/128/128/64, 3 stages, 8 warps; no TMA.
# name -> asyncgrpo's kernel tiles at head dim 128 (KernelConfig fields: query rows, key block, forward
# warps, stages; key rows, backward query rows, backward warps, stages); the first is the default.
OUR_CONFIGS = {
    "ours": (128, 64, 8, 3, 64, 64, 8, 3),
    "ours-keys128-fwd": (128, 128, 8, 2, 64, 64, 8, 3),
    "ours-rows64": (64, 64, 4, 3, 64, 64, 8, 3),
    "ours-bwd-2stages": (128, 64, 8, 3, 64, 64, 8, 2),
}
AGREEMENT = 0.05  # largest |ours - flex| / largest |flex| over bf16 outputs and gradients
KERNEL_OPTIONS = {
    "torch-defaults": {},
    "tma": {"USE_TMA": True},
    "fwd-128x128": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_stages": 2},
    "bwd-64x64": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                  "bwd_num_warps": 4},
    "bwd-2-stages": {"bwd_num_stages": 2},
    "bwd-32x128": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                   "bwd_num_warps": 4},
}  # fmt: skip


def attended_pairs(subtree_end: np.ndarray) -> int:
    """(query, key) pairs the tree rule lets attend: key k is seen by queries k .. subtree_end[k]-1."""
    return int((subtree_end - np.arange(len(subtree_end))).sum())


def rows(budget: int, vocab: int, smoke: bool):
    """One step's worth (2 tree rows) of gpu_step's shared-prefix groups, and the same samples in
    plain rows at the same token budget."""
    rng = np.random.default_rng(9)
    per_row = 1 if smoke else max(1, budget // (1068 + 8 * 256))
    tree, samples = [], []
    for _ in range(2):
        group = shared_prefix_samples(rng, per_row, vocab, smoke)
        samples += group
        batcher = TokenBudgetBatcher(10**9, 1, min_shared_tokens=BLOCK_SIZE)
        for s in group:
            batcher.offer(s)
        tree.append(batcher.close().pack()[0])
    return tree, plain_rows_within_budget(samples, budget)


def step_rows(budget: int, vocab: int, smoke: bool):
    """The default step's two DeepMath-like rows (gpu_step.deepmath_plans)."""
    plans = deepmath_plans(np.random.default_rng(7), budget, 2, vocab, smoke)
    return [row for plan in plans for row in plan.pack()]


def attention_inputs(packed_rows, device, backward: bool, ours: bool, seed: int = 0):
    """(q, k, v, mask, grad) per row, laid out as transformers does ((1, L, H, D) memory)."""
    heads, kv_heads, dim = QWEN3_1_7B_HEADS
    gen = torch.Generator(device=device).manual_seed(seed)
    inputs = []
    for row in packed_rows:
        ends = torch.as_tensor(row.subtree_end, device=device)
        layout = tree_layout(row.subtree_end, device) if ours else None
        mask = build_tree_block_mask(ends, torch.as_tensor(row.position_ids, device=device), layout=layout)
        length = padded_length(row.num_tokens)
        make = lambda h: torch.randn(1, length, h, dim, device=device, generator=gen).to(  # noqa: E731
            torch.bfloat16).transpose(1, 2).requires_grad_(backward)  # fmt: skip
        q = make(heads)
        grad = torch.randn(q.shape, device=device, generator=gen).to(torch.bfloat16)
        inputs.append((q, make(kv_heads), make(kv_heads), mask, grad))
    return inputs


def outputs_and_grads(packed_rows, inputs) -> list[torch.Tensor]:
    """Each row's output and q, k, v gradients over its real tokens, in fp32."""
    results = []
    for row, (q, k, v, mask, grad) in zip(packed_rows, inputs):
        q.grad = k.grad = v.grad = None
        out = tree_attention(q, k, v, mask)
        out.backward(grad)
        results += [t[:, :, : row.num_tokens].float() for t in (out.detach(), q.grad, k.grad, v.grad)]
    return results


def agreement(packed_rows, device) -> float:
    """Largest |ours - flex| over outputs and gradients, relative to the largest |flex|."""
    ours = outputs_and_grads(packed_rows, attention_inputs(packed_rows, device, True, True, seed=1))
    flex = outputs_and_grads(packed_rows, attention_inputs(packed_rows, device, True, False, seed=1))
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(ours, flex))


def pair_tflops(packed_rows, seconds: float, backward: bool) -> float:
    """TFLOP/s of the attended pairs (4 x pairs x head dim x query heads, x 3.5 with the backward's
    recomputation, x 3 as model FLOPs count it: reported as model FLOPs)."""
    heads, _, dim = QWEN3_1_7B_HEADS
    flops = 4 * sum(attended_pairs(r.subtree_end) for r in packed_rows) * dim * heads * (3 if backward else 1)
    return flops / seconds / 1e12


def time_rows(packed_rows, device, backward: bool, repeats: int, ours: bool = False) -> float:
    inputs = attention_inputs(packed_rows, device, backward, ours)

    def once():
        for q, k, v, mask, grad in inputs:
            out = tree_attention(q, k, v, mask)
            if backward:
                out.backward(grad)

    once()  # compile
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        once()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the script runs")
    parser.add_argument("--budget", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--flex", default="tma", help=f"flex kernel options: {', '.join(KERNEL_OPTIONS)}")
    parser.add_argument("--ours", default=",".join(OUR_CONFIGS), help="asyncgrpo kernel tiles ('' none)")
    parser.add_argument("--rows", default="step,shared", help="step (DeepMath-like) and/or shared-prefix")
    args = parser.parse_args()
    require_cuda(args.smoke)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    budget = min(args.budget, 2048) if args.smoke else args.budget
    backward = device.type == "cuda"
    if backward:
        from asyncgrpo.packing import tree_attention_kernel
    layouts, disagreements = {}, []
    if "shared" in args.rows:
        layouts["shared"] = rows(budget, 151_936, args.smoke)
    if "step" in args.rows:
        layouts["step"] = (step_rows(budget, 151_936, args.smoke), None)
    for label, (tree, plain) in layouts.items():
        tree_pairs = sum(attended_pairs(r.subtree_end) for r in tree)
        pair_ratio = None if plain is None else sum(attended_pairs(r.subtree_end) for r in plain) / tree_pairs
        print(f"{label} rows: tree {[r.num_tokens for r in tree]}, attended pairs {tree_pairs:,}"
              + ("" if plain is None else f", plain rows {[r.num_tokens for r in plain]}, "
                 f"attended-pair ratio plain/tree {pair_ratio:.3f}"), flush=True)  # fmt: skip
        variants = {f"flex-{name}": ("flex", KERNEL_OPTIONS[name]) for name in args.flex.split(",") if name}
        if backward:
            variants.update({name: ("ours", OUR_CONFIGS[name]) for name in args.ours.split(",") if name})
        else:
            variants = {"flex-torch-defaults": ("flex", {})}
        for name, (kind, options) in variants.items():
            if kind == "flex":
                tree_attention_module.FLEX_KERNEL_OPTIONS[device.type] = options
            else:
                tree_attention_kernel.HALF_CONFIGS[128] = tree_attention_kernel.KernelConfig(*options)
            try:
                forward_s = time_rows(tree, device, False, args.repeats, kind == "ours")
                tree_s = (
                    time_rows(tree, device, backward, args.repeats, kind == "ours") if backward else forward_s
                )
                plain_s = (
                    None
                    if plain is None
                    else time_rows(plain, device, backward, args.repeats, kind == "ours")
                )
                agree = agreement(tree, device) if kind == "ours" else 0.0
            except Exception as error:  # options a kernel cannot compile are a result too
                print(f"{label} {name}: failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
                if kind == "ours":
                    disagreements.append(f"{label} {name}: {type(error).__name__}")
                continue
            line = (f"tree_attention_kernels {label} {name} fwd_ms={forward_s * 1e3:.2f} "
                    f"fwd_tflops={pair_tflops(tree, forward_s, False):.0f} tree_ms={tree_s * 1e3:.2f} "
                    f"tflops={pair_tflops(tree, tree_s, backward):.0f}")  # fmt: skip
            if plain_s is not None:
                speedup = plain_s / tree_s
                line += (f" plain_ms={plain_s * 1e3:.2f} speedup={speedup:.3f} "
                         f"speedup_over_pair_ratio={speedup / pair_ratio:.3f}")  # fmt: skip
            if kind == "ours":
                line += f" max_rel_diff_vs_flex={agree:.1e}"
                if not agree < AGREEMENT:
                    disagreements.append(f"{label} {name}: {agree:.2e}")
            print(line + (" fwd+bwd" if backward else " fwd"), flush=True)
        tree_attention_module.FLEX_KERNEL_OPTIONS[device.type] = KERNEL_OPTIONS["tma"]
        if backward:
            tree_attention_kernel.HALF_CONFIGS[128] = tree_attention_kernel.KernelConfig(*OUR_CONFIGS["ours"])
    if disagreements:
        sys.exit(f"asyncgrpo's kernels disagree with flex (over {AGREEMENT}): {'; '.join(disagreements)}")


if __name__ == "__main__":
    main()
