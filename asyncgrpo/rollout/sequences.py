"""From a rollout's turns to training sequences (samples), reconciling multi-turn re-rendering.

Each turn renders the whole conversation and samples a response. A chat template does not always
render a growing conversation the same way (some drop earlier reasoning), so a turn's prompt may not
start with the tokens kept so far. Rule: a turn whose prompt starts with the kept
tokens extends the same sequence; any other turn starts a new sequence (a fork). Every generated
token is trained in exactly one sequence: a fork costs forwarded tokens, never a second gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from asyncgrpo.errors import ContractError
from asyncgrpo.rollout.types import TrainingSequence, TurnRecord


@dataclass
class ReconcileStats:
    transitions: int = 0  # turn-to-turn transitions
    forks: int = 0
    drift_tokens: list[int] | None = None  # per transition: kept tokens a fork re-rendered (0 if no fork)


def _turn_top(turn: TurnRecord) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The turn's sampler top-N as (n, N) arrays, from whichever form it carries."""
    if turn.output_top_ids is not None:
        return np.asarray(turn.output_top_ids, dtype=np.int64), np.asarray(
            turn.output_top_logprobs, dtype=np.float32
        )
    if turn.output_sampler_logprobs is None:
        return None, None
    width = max((len(entry) for entry in turn.output_sampler_logprobs), default=0)
    ids = np.full((len(turn.output_ids), width), -1, dtype=np.int64)
    values = np.full((len(turn.output_ids), width), -np.inf, dtype=np.float32)
    for position, entry in enumerate(turn.output_sampler_logprobs):
        for column, (token, logprob) in enumerate(entry.items()):
            ids[position, column] = int(token)
            values[position, column] = logprob
    return ids, values


class _SequenceBuilder:
    """Accumulates one sequence: context tokens (untrained) and sampled tokens (trained per mask)."""

    def __init__(self, model_version: int):
        self.tokens: list[np.ndarray] = []
        self.trained: list[np.ndarray] = []
        self.logprobs: list[np.ndarray] = []
        self.top_ids: list[np.ndarray] = []
        self.top_logprobs: list[np.ndarray] = []
        self.candidate_sets: list[list[np.ndarray] | int] = []  # per turn: sets, or a count without
        self.has_top = self.has_candidates = False
        self.length = 0
        self.model_version = model_version
        # The latest turn's routing: its prompt holds every token kept so far, so it covers them all.
        self.routed_experts: np.ndarray | None = None

    def add_context(self, token_ids: np.ndarray) -> None:
        self.tokens.append(token_ids)
        self.trained.append(np.zeros(len(token_ids), dtype=bool))
        self.length += len(token_ids)

    def add_turn_output(self, turn: TurnRecord) -> None:
        output = np.asarray(turn.output_ids, dtype=np.int64)
        mask = (
            np.ones(len(output), dtype=bool)
            if turn.output_mask is None
            else np.asarray(turn.output_mask, dtype=bool)
        )
        if self.length == 0:
            mask = mask.copy()
            mask[:1] = False  # nothing predicts a sequence's first token
        self.tokens.append(output)
        self.trained.append(mask)
        self.length += len(output)
        if turn.routed_experts is not None:
            self.routed_experts = turn.routed_experts
        if not mask.any():
            return
        if len(turn.output_log_probs) != len(output):
            raise ContractError(
                f"TurnRecord has {len(turn.output_log_probs)} output_log_probs for {len(output)} output_ids: "
                "the sampler log-prob of every trained token is needed for the importance ratio"
            )
        self.logprobs.append(np.asarray(turn.output_log_probs, dtype=np.float32)[mask])
        top_ids, top_logprobs = _turn_top(turn)
        if top_ids is not None:
            self.has_top = True
            self.top_ids.append(top_ids[mask])
            self.top_logprobs.append(top_logprobs[mask])
        else:
            self.top_ids.append(np.full((int(mask.sum()), 0), -1, dtype=np.int64))
            self.top_logprobs.append(np.full((int(mask.sum()), 0), -np.inf, dtype=np.float32))
        if turn.output_sampling_mask is not None:
            self.has_candidates = True
            self.candidate_sets.append(
                [
                    np.asarray(ids, dtype=np.int64)
                    for ids, keep in zip(turn.output_sampling_mask, mask)
                    if keep
                ]
            )
        else:
            self.candidate_sets.append(
                int(mask.sum())
            )  # expanded to empty sets only if another turn has sets
        self.model_version = min(self.model_version, turn.model_version)

    def token_array(self) -> np.ndarray:
        return np.concatenate(self.tokens) if self.tokens else np.zeros(0, dtype=np.int64)

    def build(self) -> TrainingSequence | None:
        """The sequence, or None when it trains nothing (pure context)."""
        if not self.logprobs:
            return None
        top_ids = top_logprobs = None
        if self.has_top:
            width = max(block.shape[1] for block in self.top_ids)
            top_ids = np.concatenate([_pad(block, width, -1) for block in self.top_ids])
            top_logprobs = np.concatenate([_pad(block, width, -np.inf) for block in self.top_logprobs])
        return TrainingSequence(
            token_ids=self.token_array(),
            trained=np.concatenate(self.trained),
            sampler_logprobs=np.concatenate(self.logprobs),
            top_ids=top_ids,
            top_logprobs=top_logprobs,
            candidate_sets=self._candidate_sets() if self.has_candidates else None,
            model_version=self.model_version,
            routed_experts=self.routed_experts,
        )

    def _candidate_sets(self) -> list[np.ndarray]:
        """One set per trained token; an empty set means the full vocabulary."""
        sets: list[np.ndarray] = []
        for block in self.candidate_sets:
            sets.extend(block if isinstance(block, list) else [np.zeros(0, dtype=np.int64)] * block)
        return sets


def _pad(block: np.ndarray, width: int, value) -> np.ndarray:
    if block.shape[1] == width:
        return block
    padded = np.full((block.shape[0], width), value, dtype=block.dtype)
    padded[:, : block.shape[1]] = block
    return padded


def build_training_sequences(turns: list[TurnRecord]) -> tuple[list[TrainingSequence], ReconcileStats]:
    """Reconcile a rollout's turns into training sequences (one unless a turn forked)."""
    stats = ReconcileStats(drift_tokens=[])
    sequences: list[TrainingSequence] = []
    builder: _SequenceBuilder | None = None
    kept = np.zeros(0, dtype=np.int64)
    for turn in turns:
        prompt = np.asarray(turn.prompt_ids, dtype=np.int64)
        if builder is None:
            builder = _SequenceBuilder(turn.model_version)
            builder.add_context(prompt)
        else:
            stats.transitions += 1
            if len(prompt) >= len(kept) and np.array_equal(prompt[: len(kept)], kept):
                builder.add_context(prompt[len(kept) :])
                stats.drift_tokens.append(0)
            else:
                stats.forks += 1
                stats.drift_tokens.append(len(kept) - _common_prefix_length(kept, prompt))
                finished = builder.build()
                if finished is not None:
                    sequences.append(finished)
                builder = _SequenceBuilder(turn.model_version)
                builder.add_context(prompt)
        builder.add_turn_output(turn)
        kept = builder.token_array()
    if builder is not None:
        finished = builder.build()
        if finished is not None:
            sequences.append(finished)
    return sequences, stats


def _common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    length = min(len(a), len(b))
    differ = np.flatnonzero(a[:length] != b[:length])
    return int(differ[0]) if len(differ) else length
