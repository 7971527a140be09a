"""GRPO-shaped packing workloads shared by the tree-attention benchmarks (CPU and GPU)."""

from __future__ import annotations

import numpy as np

from asyncgrpo.packing.row import PackedRow
from asyncgrpo.packing.trie import pack_row
from asyncgrpo.records.sample import Sample

GROUP_SIZE = 8


def make_groups(rng, groups: int, prompt_len: int, completion_len: int, vocab: int) -> list[Sample]:
    """`groups` GRPO groups: one prompt, then GROUP_SIZE completions of `completion_len` trained tokens."""
    samples = []
    for group in range(groups):
        prompt = rng.integers(0, vocab, prompt_len)
        for _ in range(GROUP_SIZE):
            tokens = np.concatenate([prompt, rng.integers(0, vocab, completion_len)])
            trained = np.arange(len(tokens)) >= prompt_len
            samples.append(Sample(tokens, trained, np.zeros(completion_len, np.float32), 1.0, group))
    return samples


def plain_row(samples: list[Sample]) -> PackedRow:
    """Padding-free packing of the same samples: one segment per sample, nothing shared."""
    lengths = np.array([s.num_tokens for s in samples])
    starts = np.cumsum(lengths) - lengths
    packed = pack_row(samples)  # reuse its loss entries (same order: sample, then token)
    return PackedRow(
        input_ids=np.concatenate([s.token_ids for s in samples]),
        position_ids=np.concatenate([np.arange(n) for n in lengths]),
        segment_ids=np.repeat(np.arange(len(samples), dtype=np.int32), lengths),
        subtree_end=np.repeat(starts + lengths, lengths),
        predict_index=np.concatenate(
            [start + np.flatnonzero(s.trained) - 1 for s, start in zip(samples, starts)]
        ),
        target_ids=packed.target_ids,
        advantages=packed.advantages,
        sampler_logprobs=packed.sampler_logprobs,
        entry_sample=packed.entry_sample,
        top_ids=None,
        top_logprobs=None,
        candidate_offsets=None,
        candidate_ids=None,
        num_samples=len(samples),
        num_unpacked_tokens=int(lengths.sum()),
        sample_versions=packed.sample_versions,
    )
