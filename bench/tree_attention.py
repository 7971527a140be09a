"""Tree packing vs plain padding-free packing: forward + backward throughput of a tiny model on CPU.

The same GRPO groups (one prompt + 8 completions) are trained two ways through the same code
(`row_logprobs`, tree attention): packed as a prefix trie (the prompt forwarded once) and packed
plainly (each sample its own segment, what padding-free packing forwards). Throughput is counted
in unpacked tokens (the samples' total length) per second of forward + backward for both, so the
speedup is directly comparable to the packing ratio, its ideal (only the forwarded tokens shrink;
attention per token does not).

Model: the tiny Qwen3 at hidden 256, 4 layers, 4 heads x 64 (2 KV heads), MLP 768, vocabulary 959:
the default tiny model (hidden 128, 2 layers) is too small for the matmuls to dominate.

Run: `.venv/bin/python bench/tree_attention.py [--record]` (--record appends to bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import time

import numpy as np
import torch
from workloads import GROUP_SIZE, make_groups, plain_row

from asyncgrpo.cli.tiny_model import TinyModelSpec, build_model, build_tokenizer
from asyncgrpo.losses.token_logprobs import row_logprobs
from asyncgrpo.packing.tree_attention import BLOCK_SIZE, enable_tree_attention
from asyncgrpo.packing.trie import pack_row

SPEC = TinyModelSpec(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64)  # fmt: skip
# (prompt length, completion length) of one group -> packing ratio 8 (P + C) / (P - 1 + 8 (C + 1)):
# the last prompt token predicts a different first completion token per sample, so it is not shared.
WORKLOADS = [(8, 256), (173, 128), (272, 64)]  # ratios 1.02, 2.00, 3.40
GROUPS_PER_ROW = 2


def fwd_bwd_seconds(model, row, repeats: int) -> float:
    """Median seconds of forward + backward of the row's summed log-probs (after two warm-ups)."""
    times = []
    for i in range(repeats + 2):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        row_logprobs(model, row).logprobs.sum().backward()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--record", action="store_true", help="append the table to bench/RESULTS.md")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = enable_tree_attention(build_model(build_tokenizer(SPEC.vocab_size), SPEC))
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    header = (
        "| prompt | completion | packing ratio | tree tokens | unpacked tokens | plain tok/s | tree tok/s "
        "| speedup |"
    )
    lines = [header, "|" + "---|" * 8]
    print("\n".join(lines), flush=True)
    speedups = []
    for prompt_len, completion_len in WORKLOADS:
        samples = make_groups(rng, GROUPS_PER_ROW, prompt_len, completion_len, vocab)
        tree, plain = (
            pack_row(samples, min_shared_tokens=BLOCK_SIZE),
            plain_row(samples),
        )  # as the trainer packs
        assert plain.num_tokens == tree.num_unpacked_tokens
        tree_s = fwd_bwd_seconds(model, tree, args.repeats)
        plain_s = fwd_bwd_seconds(model, plain, args.repeats)
        unpacked = tree.num_unpacked_tokens
        speedups.append((tree.packing_ratio, plain_s / tree_s))
        lines.append(
            f"| {prompt_len} | {completion_len} | {tree.packing_ratio:.2f} | {tree.num_tokens} "
            f"| {unpacked} | "
            f"{unpacked / plain_s:,.0f} | {unpacked / tree_s:,.0f} | {plain_s / tree_s:.2f} |"
        )
        print(lines[-1], flush=True)
    ratio, speedup = speedups[-1]
    summary = f"tree_attention speedup_at_3.4={speedup:.2f} ideal={ratio:.1f}"
    print(summary)
    if args.record:
        record("\n".join(lines), summary, args.repeats)


def record(table: str, summary: str, repeats: int) -> None:
    """Append a section (others append to the same file: never rewrite it)."""
    path = pathlib.Path(__file__).with_name("RESULTS.md")
    model = f"hidden {SPEC.hidden_size}, {SPEC.num_hidden_layers} layers, {SPEC.num_attention_heads} heads"
    section = "" if path.exists() else "# Benchmark results\n"
    section += f"""
## tree_attention (tree packing vs plain padding-free packing, fwd + bwd)
- Command: `.venv/bin/python bench/tree_attention.py --record`
- Machine: the 2-core CPU sandbox (other jobs running beside it), torch {torch.__version__}, fp32
- Date: {datetime.date.today().isoformat()}
- Workload: {GROUPS_PER_ROW} GRPO groups of 1 prompt + {GROUP_SIZE} completions per row, tiny Qwen3
  ({model} x {SPEC.head_dim}), every completion token trained; tokens/s = unpacked tokens per second
  of forward + backward (median of {repeats})
- Result: `{summary}`

{table}
"""
    with path.open("a") as f:
        f.write(section)


if __name__ == "__main__":
    main()
