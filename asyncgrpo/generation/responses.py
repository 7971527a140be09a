"""Decoding vLLM's generation responses into arrays.

The rollout worker parses every generated token's log-prob and top-N log-probs; at 512 tokens with
top-8 that is ~4,000 dict entries per response, so this path is typed msgspec decoding (unknown
fields skipped in C) followed by a single pass per token. Benchmark: `bench/client_parse.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

TOKEN_ID_PREFIX = "token_id:"
_PREFIX_LEN = len(TOKEN_ID_PREFIX)


@dataclass
class Completion:
    """One sampled continuation of a prompt, as the loss needs it.

    `top_ids`/`top_logprobs` hold the sampler's top-N tokens at each position (the set H of score
    centering), keyed by token id and padded with -1 / -inf where the server returned fewer.
    `sampling_masks` holds, per position, the candidate set the token was drawn from (top-k/top-p),
    or is None when the full vocabulary was eligible or the server cannot report it.
    """

    token_ids: np.ndarray  # (n,) int64
    logprobs: np.ndarray  # (n,) float32, processed (after temperature / top-k / top-p)
    finish_reason: str | None
    top_ids: np.ndarray | None = None  # (n, N) int64
    top_logprobs: np.ndarray | None = None  # (n, N) float32
    sampling_masks: list[np.ndarray] | None = None
    weight_version: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class _CompletionLogprobs(msgspec.Struct):
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] | None = None


class _CompletionChoice(msgspec.Struct):
    token_ids: list[int] | None = None
    logprobs: _CompletionLogprobs | None = None
    finish_reason: str | None = None


class _CompletionResponse(msgspec.Struct):
    choices: list[_CompletionChoice]


class _TokenLogprob(msgspec.Struct):
    token_id: int
    logprob: float


class _GenerateLogprobContent(msgspec.Struct):
    token_id: int
    logprob: float
    top_logprobs: list[_TokenLogprob] = []


class _GenerateLogprobs(msgspec.Struct):
    content: list[_GenerateLogprobContent] | None = None


class _WeightVersionSpan(msgspec.Struct):
    weight_version: str | None = None


class _GenerateChoice(msgspec.Struct):
    token_ids: list[int] | None = None
    logprobs: _GenerateLogprobs | None = None
    finish_reason: str | None = None
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[_WeightVersionSpan] | None = None


class _GenerateResponse(msgspec.Struct):
    choices: list[_GenerateChoice]


_completion_decoder = msgspec.json.Decoder(_CompletionResponse)
_generate_decoder = msgspec.json.Decoder(_GenerateResponse)


class MalformedResponseError(ValueError):
    """The server answered 200 with a body that lacks what was asked for."""


def parse_completion_response(body: bytes, num_top: int) -> Completion:
    """Parse a `/v1/completions` body (sent with `return_token_ids` and
    `return_tokens_as_token_ids`). `num_top` is the `logprobs` value requested.

    vLLM merges the sampled token into the top-N dict: a dict of N+1 entries holds the sampled
    token outside the top N, which is dropped so that every row is exactly the sampler's top N.
    """
    try:
        response = _completion_decoder.decode(body)
    except msgspec.DecodeError as error:
        raise MalformedResponseError(f"unreadable /v1/completions response: {error}") from error
    if not response.choices:
        raise MalformedResponseError("/v1/completions response has no choices")
    choice = response.choices[0]
    if choice.token_ids is None:
        raise MalformedResponseError("/v1/completions response has no token_ids (a vLLM older than 0.10?)")
    n = len(choice.token_ids)
    token_ids = np.asarray(choice.token_ids, dtype=np.int64)
    if choice.logprobs is None or len(choice.logprobs.token_logprobs) != n:
        raise MalformedResponseError("/v1/completions response lacks one log-prob per generated token")
    logprobs = np.asarray(
        [lp if lp is not None else -np.inf for lp in choice.logprobs.token_logprobs], dtype=np.float32
    )
    top_ids = top_logprobs = None
    if num_top > 0:
        tops = choice.logprobs.top_logprobs
        if tops is None or len(tops) != n:
            raise MalformedResponseError("/v1/completions response lacks the requested top log-probs")
        top_ids, top_logprobs = _top_from_dicts(tops, choice.token_ids, num_top)
    return Completion(token_ids, logprobs, choice.finish_reason, top_ids, top_logprobs)


def _top_from_dicts(tops: list, sampled: list[int], num_top: int) -> tuple[np.ndarray, np.ndarray]:
    n = len(tops)
    ids = np.full((n, num_top), -1, dtype=np.int64)
    values = np.full((n, num_top), -np.inf, dtype=np.float32)
    id_rows = ids.tolist()
    value_rows = values.tolist()
    for position, entries in enumerate(tops):
        if not entries:
            continue
        drop_sampled = len(entries) > num_top
        sampled_key = sampled[position]
        column = 0
        id_row = id_rows[position]
        value_row = value_rows[position]
        for key, value in entries.items():
            token = int(key[_PREFIX_LEN:])
            if drop_sampled and token == sampled_key:
                drop_sampled = False
                continue
            if column < num_top:
                id_row[column] = token
                value_row[column] = value
                column += 1
    return np.asarray(id_rows, dtype=np.int64), np.asarray(value_rows, dtype=np.float32)


def parse_generate_response(body: bytes, num_top: int) -> Completion:
    """Parse an `/inference/v1/generate` body (`output_mode="tokens"`): top log-probs arrive as a
    list with the sampled token first, then the top N in rank order."""
    try:
        response = _generate_decoder.decode(body)
    except msgspec.DecodeError as error:
        raise MalformedResponseError(f"unreadable /inference/v1/generate response: {error}") from error
    if not response.choices:
        raise MalformedResponseError("/inference/v1/generate response has no choices")
    choice = response.choices[0]
    content = choice.logprobs.content if choice.logprobs is not None else None
    token_ids_list = choice.token_ids or []
    n = len(token_ids_list)
    if content is None or len(content) != n:
        raise MalformedResponseError("/inference/v1/generate response lacks one log-prob per generated token")
    token_ids = np.asarray(token_ids_list, dtype=np.int64)
    logprobs = np.asarray([entry.logprob for entry in content], dtype=np.float32)
    top_ids = top_logprobs = None
    if num_top > 0:
        id_rows = [[-1] * num_top for _ in range(n)]
        value_rows = [[-np.inf] * num_top for _ in range(n)]
        for position, entry in enumerate(content):
            # The sampled token comes first; the top N follow it.
            candidates = entry.top_logprobs[1:] if len(entry.top_logprobs) > num_top else entry.top_logprobs
            for column, candidate in enumerate(candidates[:num_top]):
                id_rows[position][column] = candidate.token_id
                value_rows[position][column] = candidate.logprob
        top_ids = np.asarray(id_rows, dtype=np.int64)
        top_logprobs = np.asarray(value_rows, dtype=np.float32)
    masks = None
    if choice.sampling_mask is not None:
        masks = [np.asarray(ids, dtype=np.int64) for ids in choice.sampling_mask]
    version = None
    if choice.weight_versions:
        version = choice.weight_versions[-1].weight_version
    return Completion(token_ids, logprobs, choice.finish_reason, top_ids, top_logprobs, masks, version)
