"""The rollout dataclasses of TRL's API: TurnRecord, Rollout, TrainingSequence, RolloutGroup.

Field names and defaults are TRL's, so a user's `generate_one`/`generate_one_turn` override works
unchanged. Where TRL uses Python lists of dicts per token (`output_sampler_logprobs`), the
default path fills array fields instead (`output_top_ids`/`output_top_logprobs`): building 8 dicts
per generated token would cost the worker more than the HTTP call. Either form is accepted.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class TurnRecord:
    """One sampling request: the prompt sent and the tokens the sampler produced."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float] = field(default_factory=list)
    output_mask: list[int] | None = None  # 1 = train on the token; None = train on all
    output_sampling_mask: list[list[int]] | None = None  # candidate set per token (top-k/top-p)
    output_sampler_logprobs: list[dict[int, float]] | None = None  # sampler top-N per token
    # Array form of the sampler's top-N (what the default path fills): (n, N) ids and log-probs.
    output_top_ids: np.ndarray | None = None
    output_top_logprobs: np.ndarray | None = None
    finish_reason: str | None = None
    model_version: int = 0  # policy version when the request was sent
    # Not in TRL's dataclass. MoE routing replay: the experts the server routed each forwarded token
    # to, prompt then output but its last token, (len(prompt_ids) + len(output_ids) - 1, layers, top_k).
    routed_experts: np.ndarray | None = None


@dataclass
class Rollout:
    """A complete conversation generated for one prompt, as returned by `generate_one`."""

    completion: list[dict[str, Any]]
    completion_ids: list[int]
    turns: list[TurnRecord]
    tool_call_count: int = 0
    tool_failure_count: int = 0
    reward: float | None = None
    rollout_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class TrainingSequence:
    """One training sample's tokens, built from a rollout's turns (see `sequences.py`)."""

    token_ids: np.ndarray  # (L,) int64
    trained: np.ndarray  # (L,) bool
    sampler_logprobs: np.ndarray  # (T,) float32, one per trained token
    top_ids: np.ndarray | None = None  # (T, N) int64
    top_logprobs: np.ndarray | None = None  # (T, N) float32
    candidate_sets: list[np.ndarray] | None = None
    model_version: int = 0
    routed_experts: np.ndarray | None = None  # (R <= L, layers, top_k): see Sample.routed_experts


@dataclass
class RolloutGroup:
    """The `num_generations` rollouts of one prompt, scored together."""

    prompts: list[list[dict[str, Any]]]
    reward_kwargs: dict[str, list[Any]]
    completions: list[list[dict[str, Any]]]
    completions_ids: list[list[int]]
    completions_sequences: list[list[TrainingSequence]]
    tool_call_counts: list[int]
    tool_failure_counts: list[int]
    model_version: int
    group_id: int
    row_index: int
    env_rewards: list[tuple[type, float] | None]
    rollout_rewards: list[float | None]
    queued_at: float = 0.0
    rewards: np.ndarray | None = None
    # Not in TRL's dataclass: where the prompt sits in the stream of prompts (epoch * len(dataset) + k),
    # which is what resume counts, and the rollouts themselves for metrics.
    stream_index: int = -1
    epoch: int = 0
    rollouts: list[Rollout] = field(default_factory=list)
    # Each reward source's scores (one list per source, None where it did not score) and its weight
    # (reward_weights), set when the group is scored: what GDPO's aggregation normalizes per source.
    source_rewards: list[list[float | None]] = field(default_factory=list)
    source_weights: list[float] = field(default_factory=list)
