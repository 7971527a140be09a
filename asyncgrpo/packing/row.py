"""A packed row: several samples laid out as one prefix trie, ready for one forward pass.

Layout (docs/architecture.md, "Tree packing", works an example): the trie's segments (maximal runs
of tokens with one child) are laid out depth-first, so every ancestor of a token sits before it. A token at
packed index `q` may attend to packed index `kv` iff `kv <= q < subtree_end[kv]`: `kv` is at or
before `q`, and `q` lies inside the subtree of the segment that holds `kv`. With no sharing this is
the usual document mask of padding-free packing.

Loss entries are indexed per (sample, trained token): entry `e` is predicted by the output at packed
index `predict_index[e]` (the token before it in its sample) and carries its own target, advantage,
sampler log-prob and, optionally, the sampler's top-N and candidate set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class PackedRow:
    input_ids: np.ndarray  # (P,) int64
    position_ids: np.ndarray  # (P,) int64: depth in the trie = position in the sample
    segment_ids: np.ndarray  # (P,) int32: segment of each packed token, numbered in layout order
    subtree_end: np.ndarray  # (P,) int64: end (exclusive) of the subtree of the token's segment
    # Loss entries, E = trained tokens over all samples of the row.
    predict_index: np.ndarray  # (E,) int64: packed index whose output predicts the entry's token
    target_ids: np.ndarray  # (E,) int64
    advantages: np.ndarray  # (E,) float32
    sampler_logprobs: np.ndarray  # (E,) float32
    entry_sample: np.ndarray  # (E,) int32: index of the entry's sample in the row (0..S-1)
    top_ids: np.ndarray | None  # (E, N) int64, -1 padded; None when no sample carries top-N
    top_logprobs: np.ndarray | None  # (E, N) float32, -inf padded
    # Candidate sets (top-k/top-p), ragged: entry e's set is candidate_ids[candidate_offsets[e]:
    # candidate_offsets[e + 1]]; an empty set means the full vocabulary. None when no sample has any.
    candidate_offsets: np.ndarray | None  # (E + 1,) int64
    candidate_ids: np.ndarray | None  # (sum of set sizes,) int64
    num_samples: int
    num_unpacked_tokens: int  # sum of the samples' lengths: what padding-free packing would forward
    sample_versions: np.ndarray  # (S,) int64: each sample's policy version, for metrics by staleness
    # (P,) int64: how many of the row's samples contain each packed token (shared prefixes > 1); what
    # per-token losses over all forwarded tokens (the MoE load-balancing loss) weigh each token by.
    token_multiplicity: np.ndarray | None = None
    # MoE routing replay: (layers, P, top_k) the sampler's experts of each packed token, and (P,) bool
    # which tokens have one (a token shared in the trie has one routing: the first sample's). None
    # when no sample of the row carries a routing.
    routed_experts: np.ndarray | None = None
    routed: np.ndarray | None = None
    # On-policy distillation: (E, K) the teacher's reported tokens and log-probs at each entry, -1 / -inf
    # padded (an entry of a sample without a teacher has none), and (S,) each sample's teacher (-1:
    # none). None when no sample of the row carries a teacher's scores.
    teacher_ids: np.ndarray | None = None
    teacher_logprobs: np.ndarray | None = None
    sample_teachers: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens forwarded (shared tokens counted once)."""
        return len(self.input_ids)

    @property
    def num_shared_tokens(self) -> int:
        """Tokens the trie saved: unpacked minus forwarded."""
        return self.num_unpacked_tokens - self.num_tokens

    @property
    def num_entries(self) -> int:
        return len(self.target_ids)

    @property
    def attention_cost(self) -> int:
        """Query-key pairs the row's attention computes: each token sees its depth + 1 keys."""
        return int(self.position_ids.sum()) + len(self.position_ids)

    @property
    def packing_ratio(self) -> float:
        return self.num_unpacked_tokens / max(self.num_tokens, 1)
