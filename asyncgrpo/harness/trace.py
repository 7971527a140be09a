"""The capture contract: a captured turn as a `TrainingTurn` (OpenEnv's type, harness/contract.py),
and back as the `TurnRecord` the sample builder (rollout/sequences.py) chains by exact token prefix.

What the loss needs of every trained token, and what a turn must therefore carry: the prompt ids and
completion ids as the engine saw them (never re-tokenized), the sampler's log-prob of each completion
token, the sampler's top-N at each (`num_sampler_logprobs`, when the loss centers on them) and the
policy version that sampled the turn. The first three are checked when a turn is captured and again
when any session's trace is read (a producer of its own may skip the check); the rest travels in its
`metadata` under the keys below. A trace that breaks the contract stops the run
(`CaptureContractError`): training on misaligned tokens still trains, on garbage.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from asyncgrpo.errors import HarnessError
from asyncgrpo.harness.contract import TrainingTrace, TrainingTurn, check_training_turn
from asyncgrpo.rollout.types import TurnRecord

# metadata keys of a TrainingTurn that carry what OpenEnv's fields do not
POLICY_VERSION_KEY = "policy_version"  # the weight label's version that sampled the turn
TOP_IDS_KEY = "sampler_top_ids"  # (completion length, N) ids, -1 padded
TOP_LOGPROBS_KEY = "sampler_top_logprobs"  # (completion length, N) log-probs, -inf padded
SAMPLING_MASK_KEY = "sampling_mask"  # per completion token, its candidate set (top-k/top-p runs)
FINISH_REASON_KEY = "finish_reason"


class CaptureContractError(HarnessError, ValueError):
    """A captured turn cannot be trained on: ids that do not match the log-probs, a turn without
    ids, a missing top-N the loss needs, a malformed mask."""


def training_turn(
    turn: TurnRecord, node_id: str, request: dict[str, Any], response: dict[str, Any]
) -> TrainingTurn:
    """One sampled turn as an OpenEnv TrainingTurn (its completion trained, its prompt context)."""
    metadata: dict[str, Any] = {POLICY_VERSION_KEY: turn.model_version, FINISH_REASON_KEY: turn.finish_reason}
    if turn.output_top_ids is not None:
        metadata[TOP_IDS_KEY] = np.asarray(turn.output_top_ids).tolist()
        metadata[TOP_LOGPROBS_KEY] = np.asarray(turn.output_top_logprobs).tolist()
    if turn.output_sampling_mask is not None:
        metadata[SAMPLING_MASK_KEY] = turn.output_sampling_mask
    try:
        return TrainingTurn(
            node_id=node_id,
            prompt_token_ids=[int(token) for token in turn.prompt_ids],
            completion_token_ids=[int(token) for token in turn.output_ids],
            per_token_logps=[float(value) for value in turn.output_log_probs],
            loss_mask=[0] * len(turn.prompt_ids) + [1] * len(turn.output_ids),
            request=request,
            response=response,
            metadata=metadata,
        )
    except ValueError as error:
        raise CaptureContractError(f"captured turn {node_id} breaks the capture contract: {error}") from error


def turns_from_trace(trace: TrainingTrace, default_version: int, top_n: int) -> list[TurnRecord]:
    """The trace's turns as TurnRecords, in order. `default_version`: the policy version of turns
    whose producer did not record one (the session's first, so staleness is never undercounted);
    `top_n`: the sampler top-N width the loss needs (0: none)."""
    turns = []
    for turn in trace.turns:
        tag = f"captured turn {turn.node_id}"
        prompt, output = turn.prompt_token_ids, turn.completion_token_ids
        if not prompt or not output:
            raise CaptureContractError(
                f"{tag} has {len(prompt)} prompt ids and {len(output)} completion ids: every turn must "
                "carry the ids the engine saw and sampled (a proxy that re-tokenizes or drops them cannot "
                "be trained on)"
            )
        try:
            check_training_turn(prompt, output, turn.per_token_logps, turn.loss_mask)
        except ValueError as error:
            raise CaptureContractError(f"{tag} breaks the capture contract: {error}") from error
        mask = turn.loss_mask[len(prompt) :]
        top_ids = top_logprobs = None
        if TOP_IDS_KEY in turn.metadata:
            top_ids = np.asarray(turn.metadata[TOP_IDS_KEY], dtype=np.int64)
            top_logprobs = np.asarray(turn.metadata[TOP_LOGPROBS_KEY], dtype=np.float32)
            if top_ids.shape != top_logprobs.shape or top_ids.ndim != 2 or len(top_ids) != len(output):
                raise CaptureContractError(
                    f"{tag}: sampler top-N of shapes {top_ids.shape} and {top_logprobs.shape} for "
                    f"{len(output)} completion ids; one row of N per completion token is needed"
                )
        if top_n and any(mask) and (top_ids is None or top_ids.shape[1] < top_n):
            found = 0 if top_ids is None else top_ids.shape[1]
            raise CaptureContractError(
                f"{tag} carries a sampler top-{found} but score_centering needs the top-{top_n} "
                f"(num_sampler_logprobs) of every trained token: capture through the trainer's proxy, or "
                f"record them in the turn's metadata[{TOP_IDS_KEY!r}]/[{TOP_LOGPROBS_KEY!r}]"
            )
        turns.append(
            TurnRecord(
                prompt_ids=list(prompt),
                output_ids=list(output),
                output_log_probs=list(turn.per_token_logps),
                output_mask=list(mask),
                output_sampling_mask=turn.metadata.get(SAMPLING_MASK_KEY),
                output_top_ids=top_ids,
                output_top_logprobs=top_logprobs,
                finish_reason=turn.metadata.get(FINISH_REASON_KEY),
                model_version=int(turn.metadata.get(POLICY_VERSION_KEY, default_version)),
            )
        )
    return turns
