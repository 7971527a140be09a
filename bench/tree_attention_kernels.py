"""Part benchmark: tree attention alone (one Qwen3-1.7B layer's flex attention, forward + backward)
on one step's shared-prefix rows of bench/gpu_step.py, tree-packed vs plain padding-free, per set of
FlexAttention kernel options (tile shapes, TMA).

Why: in the whole step, attention is where tree rows gain least over plain rows. This measures (a)
whether tree attention is as efficient per attended (query, key) pair as plain attention: the
`speedup_over_pair_ratio` it prints is 1.0 when it is; (b) which kernel options make flex attention
faster on this GPU, for both kinds of rows (asyncgrpo.packing.tree_attention.FLEX_KERNEL_OPTIONS).

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
from gpu_step import plain_rows_within_budget, shared_prefix_samples  # noqa: E402
from gpu_training import require_cuda  # noqa: E402

from asyncgrpo.packing import tree_attention as tree_attention_module  # noqa: E402
from asyncgrpo.packing.planner import TokenBudgetBatcher  # noqa: E402
from asyncgrpo.packing.tree_attention import (  # noqa: E402
    BLOCK_SIZE,
    build_tree_block_mask,
    padded_length,
    tree_attention,
)

QWEN3_1_7B_HEADS = (16, 8, 128)  # query heads, key/value heads, head dim
# name -> FlexAttention kernel options; torch's defaults on an H100/H200 (bf16, head dim 128):
# forward 128 x 64 tiles, 3 stages, 8 warps; backward 64/128/128/64, 3 stages, 8 warps; no TMA.
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


def time_rows(packed_rows, device, backward: bool, repeats: int) -> float:
    heads, kv_heads, dim = QWEN3_1_7B_HEADS
    inputs = []
    for row in packed_rows:
        ends = torch.as_tensor(row.subtree_end, device=device)
        mask = build_tree_block_mask(ends, torch.as_tensor(row.position_ids, device=device))
        length = padded_length(row.num_tokens)
        make = lambda h: torch.randn(1, h, length, dim, device=device, dtype=torch.bfloat16,  # noqa: E731
                                     requires_grad=backward)  # fmt: skip
        inputs.append((make(heads), make(kv_heads), make(kv_heads), mask))

    def once():
        for q, k, v, mask in inputs:
            out = tree_attention(q, k, v, mask)
            if backward:
                out.backward(torch.ones_like(out))

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
    args = parser.parse_args()
    require_cuda(args.smoke)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    budget = min(args.budget, 2048) if args.smoke else args.budget
    tree, plain = rows(budget, 151_936, args.smoke)
    pair_ratio = sum(attended_pairs(r.subtree_end) for r in plain) / sum(
        attended_pairs(r.subtree_end) for r in tree
    )
    print(f"tree rows {[r.num_tokens for r in tree]}, plain rows {[r.num_tokens for r in plain]}, "
          f"attended-pair ratio plain/tree {pair_ratio:.3f}", flush=True)  # fmt: skip
    backward = device.type == "cuda"
    variants = KERNEL_OPTIONS if backward else {"torch-defaults": {}}
    for name, options in variants.items():
        tree_attention_module.FLEX_KERNEL_OPTIONS[device.type] = options
        try:
            tree_s = time_rows(tree, device, backward, args.repeats)
            plain_s = time_rows(plain, device, backward, args.repeats)
        except Exception as error:  # options flex cannot compile are a result too
            print(f"{name}: failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
            continue
        speedup = plain_s / tree_s
        print(f"tree_attention_kernels {name} tree_ms={tree_s * 1e3:.2f} plain_ms={plain_s * 1e3:.2f} "
              f"speedup={speedup:.3f} speedup_over_pair_ratio={speedup / pair_ratio:.3f} "
              f"{'fwd+bwd' if backward else 'fwd'}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
