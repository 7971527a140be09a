"""Part benchmark: the fused head's two passes over the logits (asyncgrpo.kernels.head_kernels) on a GPU.

Times the forward pass (log-normalizer and entropy) and the backward pass (d loss / d logits, in
place) over one row's bf16 logits, E trained entries x a 152k vocabulary, for a few block sizes
and warp counts, and reports the memory bandwidth each reaches (forward reads E x V x 2 bytes,
backward reads and writes them). The step's own figure is bench/gpu_step.py; this one picks the
kernels' launch settings. A part of the step, not the step.

Run (GPU machine): `python bench/fused_head_passes.py`. Prints
`fused_head_passes stats_ms=X grad_ms=Y` for the module's settings last.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_training import require_cuda  # noqa: E402


def timed_ms(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--entries", type=int, default=10240, help="trained entries of the row")
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args()
    require_cuda(smoke=None)
    from asyncgrpo.kernels import head_kernels  # Triton, which CPU machines lack: after the check

    gen = torch.Generator(device="cuda").manual_seed(0)
    raw = (torch.randn(args.entries, args.vocab, device="cuda", generator=gen) * 3).bfloat16()
    targets = torch.randint(0, args.vocab, (args.entries,), device="cuda", generator=gen)
    top_ids = torch.randint(0, args.vocab, (args.entries, 8), device="cuda", generator=gen)
    grads = torch.randn(3, args.entries, device="cuda", generator=gen)
    g_top = torch.randn(args.entries, 8, device="cuda", generator=gen)
    _, entropy, _, lse = head_kernels.chunk_forward(raw, targets, top_ids, None, 1.0, None, 1.0)
    out = torch.empty_like(raw)
    nbytes = raw.numel() * raw.element_size()
    defaults = (
        head_kernels.STATS_BLOCK,
        head_kernels.STATS_WARPS,
        head_kernels.GRAD_BLOCK,
        head_kernels.GRAD_WARPS,
    )

    def forward():
        head_kernels.chunk_forward(raw, targets, top_ids, None, 1.0, None, 1.0)

    def backward():
        head_kernels.chunk_backward(raw, lse, entropy, targets, top_ids, None, grads[0], grads[1], g_top,
                                    1.0, None, 1.0, raw.dtype, out=out)  # fmt: skip

    print(f"{args.entries} entries x {args.vocab} vocabulary, bf16: {nbytes / 1e9:.2f} GB of logits")
    for block, warps in itertools.product((1024, 2048, 4096), (4, 8, 16)):
        head_kernels.STATS_BLOCK, head_kernels.STATS_WARPS = block, warps
        ms = timed_ms(forward)
        print(f"stats block {block} warps {warps}: {ms:.2f} ms, {nbytes / ms / 1e6:.0f} GB/s", flush=True)
    head_kernels.STATS_BLOCK, head_kernels.STATS_WARPS = defaults[:2]
    for block, warps in itertools.product((1024, 2048, 4096), (4, 8)):
        head_kernels.GRAD_BLOCK, head_kernels.GRAD_WARPS = block, warps
        ms = timed_ms(backward)
        print(f"grad block {block} warps {warps}: {ms:.2f} ms, {2 * nbytes / ms / 1e6:.0f} GB/s", flush=True)
    head_kernels.GRAD_BLOCK, head_kernels.GRAD_WARPS = defaults[2:]
    print(f"fused_head_passes stats_ms={timed_ms(forward):.2f} grad_ms={timed_ms(backward):.2f}")


if __name__ == "__main__":
    main()
