"""The training sample: what the rollout worker queues and the trainer packs.

A sample is one token sequence (prompt, completion, tool results) with a mask of the tokens the loss
trains on. Every per-token array that only matters at trained tokens (sampler top-N log-probs,
candidate sets) is stored for the trained tokens alone, in sequence order: a 2,000-token completion
with top-8 log-probs is 16k numbers, a full-length copy would waste the queue's bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from asyncgrpo.errors import ContractError


@dataclass
class Sample:
    token_ids: np.ndarray  # (L,) int64
    trained: np.ndarray  # (L,) bool; trained[0] is always False (nothing predicts the first token)
    sampler_logprobs: np.ndarray  # (T,) float32: the sampler's processed log-prob of each trained token
    advantage: float
    group_id: int
    # Score centering: the sampler's top-N tokens at each trained token's position (-1 / -inf padded).
    top_ids: np.ndarray | None = None  # (T, N) int64
    top_logprobs: np.ndarray | None = None  # (T, N) float32
    # top-k / top-p: the candidate set each trained token was drawn from; None = full vocabulary.
    candidate_sets: list[np.ndarray] | None = None  # T arrays of token ids
    model_version: int = 0  # policy version that generated it (the oldest turn's)
    # MoE routing replay: the experts the sampler routed each of the first R <= L tokens to, per MoE
    # layer, (R, layers, top_k), in the narrowest integer type that holds the expert count (uint8 up
    # to 256 experts: a routing can outweigh the rest of a sample). None: not recorded.
    routed_experts: np.ndarray | None = None
    # On-policy distillation: the teacher's reported tokens at each trained token's position (its top-k
    # in rank order plus the realized token, -1 / -inf padded), and which teacher scored the sample
    # (its place in teacher_server_urls). None / -1: no teacher.
    teacher_ids: np.ndarray | None = None  # (T, K) int64
    teacher_logprobs: np.ndarray | None = None  # (T, K) float32
    teacher_index: int = -1
    # GRPO with a teacher (teacher_kl_coef): each trained token's own advantage, `advantage` plus its
    # teacher term. None: every trained token takes `advantage`.
    token_advantages: np.ndarray | None = None  # (T,) float32
    row_index: int = -1  # dataset row of its prompt
    stream_index: int = -1  # the prompt's place in the stream of prompts (epoch * len(dataset) + k)
    epoch: int = 0
    reward: float = math.nan
    rollout_id: str = ""
    queued_at: float = 0.0  # time.time() when the worker queued it
    metadata: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_trained(self) -> int:
        return len(self.sampler_logprobs)

    def validate(self) -> None:
        """Raise ValueError naming the broken invariant: a bug in whoever built the sample (a custom
        `generate_one`). Explicit checks, not asserts, so that `python -O` keeps them."""
        problem = self._broken_invariant()
        if problem:
            raise ContractError(
                f"malformed sample (rollout {self.rollout_id!r}, dataset row {self.row_index}): {problem}"
            )

    def _broken_invariant(self) -> str | None:
        length = len(self.token_ids)
        if self.trained.shape != (length,):
            return "trained mask must match token_ids"
        if length and self.trained[0]:
            return "the first token cannot be trained"
        trained = int(self.trained.sum())
        if self.sampler_logprobs.shape != (trained,):
            return "one sampler log-prob per trained token"
        if self.top_ids is not None:
            if self.top_logprobs is None or self.top_ids.shape != self.top_logprobs.shape:
                return "top_ids and top_logprobs must have the same shape"
            if self.top_ids.shape[0] != trained:
                return "one top-N row per trained token"
        if self.teacher_ids is not None:
            if self.teacher_logprobs is None or self.teacher_ids.shape != self.teacher_logprobs.shape:
                return "teacher_ids and teacher_logprobs must have the same shape"
            if self.teacher_ids.ndim != 2 or self.teacher_ids.shape[0] != trained:
                return "one row of teacher tokens per trained token"
        if self.token_advantages is not None and self.token_advantages.shape != (trained,):
            return "one token advantage per trained token"
        if self.candidate_sets is not None and len(self.candidate_sets) != trained:
            return "one candidate set per trained token"
        if self.routed_experts is not None and (
            self.routed_experts.ndim != 3 or len(self.routed_experts) > length
        ):
            return "routed_experts must be (tokens, MoE layers, top_k) for at most the sample's tokens"
        return None
