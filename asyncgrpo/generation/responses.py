"""Decoding vLLM's generation responses into arrays.

The rollout worker parses every generated token's log-prob and top-N log-probs; at 512 tokens with
top-8 that is ~4,000 dict entries per response, so this path is typed msgspec decoding (unknown
fields skipped in C) followed by a single pass per token. Benchmark: `bench/client_parse.py`.
"""

from __future__ import annotations

import base64
import io
import itertools
from dataclasses import dataclass

import msgspec
import numpy as np

from asyncgrpo.generation.errors import MalformedResponseError

TOKEN_ID_PREFIX = "token_id:"
_PREFIX_LEN = len(TOKEN_ID_PREFIX)
_QUOTED_KEY_PREFIX = b'"' + TOKEN_ID_PREFIX.encode()  # how each top-N key starts in the raw body
# Blanked rather than deleted: a replace that keeps the length copies once and writes in place.
_KEY_PREFIX_BLANKS = b" " * len(_QUOTED_KEY_PREFIX)


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
    # The weight-version labels of the weights that sampled the tokens, in order (token route only;
    # () when the server does not report them). More than one: a weight sync happened mid-request.
    weight_labels: tuple[str, ...] = ()
    # MoE routing replay (token route, a server with --enable-return-routed-experts): the experts
    # each forwarded token (prompt, then every output token but the last) was routed to,
    # (prompt + n - 1, layers, top_k) in the narrowest unsigned type; None when not returned.
    routed_experts: np.ndarray | None = None
    server_url: str | None = None  # the server that answered (set by the client)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class _CompletionLogprobs(msgspec.Struct):
    token_logprobs: list[float | None] = []
    # Left raw: ~4,000 small dicts per response are parsed straight from the bytes (see _top_from_raw).
    top_logprobs: msgspec.Raw = msgspec.Raw(b"null")


class _CompletionChoice(msgspec.Struct):
    token_ids: list[int] | None = None
    logprobs: _CompletionLogprobs | None = None
    finish_reason: str | None = None


class _CompletionResponse(msgspec.Struct):
    choices: list[_CompletionChoice]


class _TokenLogprob(msgspec.Struct):
    token_id: int
    logprob: float
    rank: int | None = None  # 1 = most likely; absent when the log-prob was NaN


class _GenerateLogprobContent(msgspec.Struct):
    token_id: int
    logprob: float
    top_logprobs: list[_TokenLogprob] = []


class _GenerateLogprobs(msgspec.Struct):
    content: list[_GenerateLogprobContent] | None = None


class _WeightVersionSpan(msgspec.Struct):
    """Output tokens [start, end) were sampled by the weights labelled `version`."""

    version: str
    start: int = 0
    end: int = 0


class _GenerateChoice(msgspec.Struct):
    token_ids: list[int] | None = None
    logprobs: _GenerateLogprobs | None = None
    finish_reason: str | None = None
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[_WeightVersionSpan] | None = None
    routed_experts: str | None = None  # base64 of a `.npy` array


class _GenerateResponse(msgspec.Struct):
    choices: list[_GenerateChoice]


_completion_decoder = msgspec.json.Decoder(_CompletionResponse)
_top_dicts_decoder = msgspec.json.Decoder(list[dict[str, float] | None] | None)
_number_rows_decoder = msgspec.json.Decoder(list[list[float]])
# Quotes become spaces rather than being deleted: a translate that deletes bytes is several times slower
# than a plain one, and JSON allows the spaces.
_TO_NUMBER_LISTS = bytes.maketrans(b'{}:"', b"[], ")
_generate_decoder = msgspec.json.Decoder(_GenerateResponse)


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
    # JSON carries no NaN, so a NaN here is a null: a token whose log-prob the server could not give.
    logprobs = np.asarray(choice.logprobs.token_logprobs, dtype=np.float32)
    logprobs[np.isnan(logprobs)] = -np.inf
    top_ids = top_logprobs = None
    if num_top > 0:
        raw = bytes(choice.logprobs.top_logprobs)
        parsed = _top_from_raw(raw, choice.token_ids, num_top)
        if parsed is None:  # an unusual body (null entries...): the general path
            tops = _top_dicts_decoder.decode(raw)
            if tops is None or len(tops) != n:
                raise MalformedResponseError("/v1/completions response lacks the requested top log-probs")
            parsed = _top_from_dicts(tops, choice.token_ids, num_top)
        top_ids, top_logprobs = parsed
    return Completion(token_ids, logprobs, choice.finish_reason, top_ids, top_logprobs)


def _top_from_raw(raw: bytes, sampled: list[int], num_top: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Vectorized parse of `[{"token_id:ID": logprob, ...}, ...]`; None when the shape is unusual.

    vLLM builds each dict from [sampled, top 1..N]; when the sampled token is among the top N its
    key collapses, so a dict holds N entries, else N+1 with the sampled token first (dropped here).
    """
    n = len(sampled)
    # Turn every {"token_id:ID": lp, ...} into [ ID , lp, ...] so that msgspec parses all the numbers in C:
    # one replace that blanks the key prefix, then one translate pass ({ -> [, } -> ], : -> ",", quotes
    # -> spaces).
    text = raw.replace(_QUOTED_KEY_PREFIX, _KEY_PREFIX_BLANKS).translate(_TO_NUMBER_LISTS)
    try:
        number_rows = _number_rows_decoder.decode(text)
    except msgspec.DecodeError:  # null entries, -Infinity...: not this shape
        return None
    if len(number_rows) != n:
        return None
    counts = np.fromiter(map(len, number_rows), dtype=np.int64, count=n) // 2
    flat = np.fromiter(
        itertools.chain.from_iterable(number_rows), dtype=np.float64, count=int(counts.sum()) * 2
    )
    ids = flat[0::2].astype(np.int64)
    values = flat[1::2].astype(np.float32)
    starts = np.cumsum(counts) - counts
    extra = counts > num_top  # the sampled token sits first in these rows
    if extra.any() and not np.array_equal(ids[starts[extra]], np.asarray(sampled, dtype=np.int64)[extra]):
        return None
    if np.all((counts == num_top) | (counts == num_top + 1)):
        # The usual body: with the sampled tokens outside the top N dropped, every row holds exactly N,
        # so the arrays are a reshape (no padding, no scatter).
        kept = np.ones(len(ids), dtype=bool)
        kept[starts[extra]] = False
        return ids[kept].reshape(n, num_top), values[kept].reshape(n, num_top)
    rows = np.repeat(np.arange(n), counts)
    columns = np.arange(len(ids)) - starts[rows]
    shift = extra[rows].astype(np.int64)
    keep = (columns >= shift) & (columns - shift < num_top)
    top_ids = np.full((n, num_top), -1, dtype=np.int64)
    top_logprobs = np.full((n, num_top), -np.inf, dtype=np.float32)
    top_ids[rows[keep], (columns - shift)[keep]] = ids[keep]
    top_logprobs[rows[keep], (columns - shift)[keep]] = values[keep]
    return top_ids, top_logprobs


def _top_from_dicts(tops: list, sampled: list[int], num_top: int) -> tuple[np.ndarray, np.ndarray]:
    """The general path: one dict (or None) per position."""
    n = len(tops)
    id_rows = [[-1] * num_top for _ in range(n)]
    value_rows = [[-np.inf] * num_top for _ in range(n)]
    for position, entries in enumerate(tops):
        if not entries:
            continue
        drop_sampled = len(entries) > num_top
        column = 0
        for key, value in entries.items():
            token = int(key[_PREFIX_LEN:])
            if drop_sampled and token == sampled[position]:
                drop_sampled = False
                continue
            if column < num_top:
                id_rows[position][column] = token
                value_rows[position][column] = value
                column += 1
    return np.asarray(id_rows, dtype=np.int64), np.asarray(value_rows, dtype=np.float32)


def parse_generate_response(body: bytes, num_top: int) -> Completion:
    """Parse an `/inference/v1/generate` body (`output_mode="tokens"`). Each token's list holds the
    sampled token first, then the most likely tokens in rank order, cut to the `logprobs` asked for;
    `generate_tokens` asks for one more than `num_top` so that the cut never removes one of the top
    `num_top`, which are then picked by rank."""
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
            if entry.top_logprobs and all(candidate.rank is None for candidate in entry.top_logprobs):
                raise MalformedResponseError(
                    "/inference/v1/generate top log-probs carry no ranks, so the top N cannot be picked: "
                    "this vLLM is too old for the token route; serve without --enable-scale-out"
                )
            candidates = sorted(
                (
                    candidate
                    for candidate in entry.top_logprobs
                    if candidate.rank is not None and candidate.rank <= num_top
                ),
                key=lambda candidate: candidate.rank,
            )
            for column, candidate in enumerate(candidates):
                id_rows[position][column] = candidate.token_id
                value_rows[position][column] = candidate.logprob
        top_ids = np.asarray(id_rows, dtype=np.int64)
        top_logprobs = np.asarray(value_rows, dtype=np.float32)
    masks = None
    if choice.sampling_mask is not None:
        masks = [np.asarray(ids, dtype=np.int64) for ids in choice.sampling_mask]
    labels = tuple(span.version for span in choice.weight_versions or ())
    routing = None if choice.routed_experts is None else decode_routed_experts(choice.routed_experts)
    return Completion(
        token_ids, logprobs, choice.finish_reason, top_ids, top_logprobs, masks, labels, routing
    )


def decode_routed_experts(encoded: str) -> np.ndarray:
    """vLLM's routed experts (base64 of a `.npy` array, (tokens, layers, top_k)) in the narrowest
    unsigned type that holds them: a routing is tokens x layers x top_k ids, more than the rest of a
    sample, and it travels through the queue with it."""
    try:
        routing = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    except (ValueError, OSError) as error:
        raise MalformedResponseError(f"unreadable routed_experts in a generate response: {error}") from error
    if routing.ndim != 3:
        raise MalformedResponseError(
            f"routed_experts of shape {routing.shape}: expected (tokens, layers, experts per token)"
        )
    return compact_routing(routing)


def compact_routing(routing: np.ndarray) -> np.ndarray:
    """`routing` as uint8 when every expert id fits (up to 256 experts), else uint16."""
    largest = int(routing.max()) if routing.size else 0
    return routing.astype(np.uint8 if largest <= np.iinfo(np.uint8).max else np.uint16, copy=False)


class _RankedLogprob(msgspec.Struct):
    logprob: float | None  # None: a NaN, as vLLM's JSON writes it
    rank: int | None = None  # 1 = most likely


class _PromptLogprobsChoice(msgspec.Struct):
    prompt_logprobs: list[dict[str, _RankedLogprob] | None] | None = None


class _PromptLogprobsResponse(msgspec.Struct):
    # `/v1/completions` answers in its choice; the token route (`/inference/v1/generate`) at the top.
    choices: list[_PromptLogprobsChoice] = []
    prompt_logprobs: list[dict[str, _RankedLogprob] | None] | None = None


_prompt_logprobs_decoder = msgspec.json.Decoder(_PromptLogprobsResponse)


def parse_prompt_logprobs(body: bytes, positions: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """A teacher-forced scoring's answer (`prompt_logprobs`, either route's) at `positions` (indices
    into the scored sequence): (ids (n, width) int64, log-probs (n, width) float32), each row in rank
    order (the top-1 first), -1 / -inf padded. vLLM reports the top-k candidates plus the realized
    token when it ranks lower; a NaN log-prob is dropped (not a score), a position without a report is
    all padding."""
    try:
        answer = _prompt_logprobs_decoder.decode(body)
    except msgspec.DecodeError as error:
        raise MalformedResponseError(f"unreadable prompt_logprobs response: {error}") from error
    reports = answer.prompt_logprobs
    if reports is None and answer.choices:
        reports = answer.choices[0].prompt_logprobs
    if reports is None:
        raise MalformedResponseError("the server answered without prompt_logprobs")
    ids = np.full((len(positions), width), -1, dtype=np.int64)
    logprobs = np.full((len(positions), width), -np.inf, dtype=np.float32)
    for row, position in enumerate(positions.tolist()):
        report = reports[position] if position < len(reports) else None
        if not report:
            continue
        ranked = sorted(
            (
                (
                    entry.rank if entry.rank is not None else 1 << 30,
                    int(key.removeprefix(TOKEN_ID_PREFIX)),
                    value,
                )
                for key, entry in report.items()
                if (value := entry.logprob) is not None and value == value  # NaN is not equal to itself
            ),
        )[:width]
        for column, (_, token, value) in enumerate(ranked):
            ids[row, column], logprobs[row, column] = token, value
    return ids, logprobs
