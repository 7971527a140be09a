"""Parsing vLLM responses: the vectorized top-N path agrees with the general one."""

from __future__ import annotations

import json

import numpy as np
import pytest

msgspec = pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

from asyncgrpo.generation.responses import (  # noqa: E402
    MalformedResponseError,
    _top_dicts_decoder,
    _top_from_dicts,
    parse_completion_response,
    parse_generate_response,
)


def completion_body(token_ids, tops, compact=True) -> bytes:
    choice = {
        "index": 0,
        "text": "",
        "token_ids": token_ids,
        "finish_reason": "length",
        "logprobs": {
            "token_logprobs": [next(iter(top.values())) if top else None for top in tops],
            "top_logprobs": tops,
        },
    }
    separators = (",", ":") if compact else (", ", ": ")
    return json.dumps({"choices": [choice]}, separators=separators).encode()


def test_sampled_token_outside_the_top_n_is_dropped_and_inside_it_is_kept():
    # Position 0: sampled 7 is among the top 2 (dict of 2). Position 1: sampled 9 is not (dict of 3).
    # -2.5e-06: JSON writes a log-prob near 0 with an exponent.
    tops = [
        {"token_id:7": -0.1, "token_id:3": -2.5e-06},
        {"token_id:9": -4.0, "token_id:1": -0.2, "token_id:2": -1.7},
    ]
    for compact in (True, False):
        completion = parse_completion_response(completion_body([7, 9], tops, compact), num_top=2)
        assert completion.token_ids.tolist() == [7, 9]
        assert completion.top_ids.tolist() == [[7, 3], [1, 2]]
        np.testing.assert_allclose(completion.top_logprobs, [[-0.1, -2.5e-06], [-0.2, -1.7]])
        np.testing.assert_allclose(completion.logprobs, [-0.1, -4.0])


def test_fast_path_matches_the_general_path_on_random_bodies():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n, top = int(rng.integers(1, 40)), int(rng.integers(1, 9))
        sampled = rng.integers(0, 500, n).tolist()
        tops = []
        for token in sampled:
            entries = {f"token_id:{token}": float(-rng.random())}
            while len(entries) < top + int(rng.integers(0, 2)):
                entries[f"token_id:{int(rng.integers(0, 500))}"] = float(-rng.random() * 9)
            tops.append(entries)
        body = completion_body(sampled, tops)
        fast = parse_completion_response(body, top)
        raw = msgspec.json.encode(tops)
        general_ids, general_values = _top_from_dicts(_top_dicts_decoder.decode(raw), sampled, top)
        np.testing.assert_array_equal(fast.top_ids, general_ids)
        np.testing.assert_array_equal(fast.top_logprobs, general_values)


def test_rows_shorter_or_longer_than_the_top_n_match_the_general_path():
    # A row may hold fewer than N entries (fewer candidates than asked for) or more than N + 1: the
    # fast path pads or cuts them as the general one does, with or without such rows in the body.
    rng = np.random.default_rng(1)
    for _ in range(20):
        n, top = int(rng.integers(1, 40)), int(rng.integers(2, 9))
        sampled = rng.integers(0, 500, n).tolist()
        tops = []
        for token in sampled:
            entries = {f"token_id:{token}": float(-rng.random())}
            while len(entries) < int(rng.integers(1, top + 3)):
                entries[f"token_id:{int(rng.integers(0, 500))}"] = float(-rng.random() * 9)
            tops.append(entries)
        fast = parse_completion_response(completion_body(sampled, tops), top)
        general_ids, general_values = _top_from_dicts(
            _top_dicts_decoder.decode(msgspec.json.encode(tops)), sampled, top
        )
        np.testing.assert_array_equal(fast.top_ids, general_ids)
        np.testing.assert_array_equal(fast.top_logprobs, general_values)


def test_null_entries_take_the_general_path():
    tops = [{"token_id:7": -0.1, "token_id:3": -2.5}, None]
    completion = parse_completion_response(completion_body([7, 9], tops), num_top=2)
    assert completion.top_ids.tolist() == [[7, 3], [-1, -1]]
    assert np.isneginf(completion.top_logprobs[1]).all()
    # The second token's log-prob is null in the body: it reads as -inf, never as NaN.
    assert completion.logprobs[0] == np.float32(-0.1)
    assert np.isneginf(completion.logprobs[1])


def test_missing_logprobs_is_a_clear_error():
    body = json.dumps({"choices": [{"token_ids": [1, 2], "logprobs": None}]}).encode()
    with pytest.raises(MalformedResponseError, match="one log-prob per generated token"):
        parse_completion_response(body, num_top=0)


def test_generate_endpoint_body():
    # vLLM's shape for logprobs=3 (num_top + 1, as generate_tokens asks): the sampled token first,
    # then the most likely in rank order, cut to 3 entries. The top 2 are picked by rank whether the
    # sampled token is one of them (position 0), outside the list's top 3 (1), or third (2).
    def entry(token_id, ranked):
        top = [{"token_id": t, "logprob": -0.1 * r, "rank": r} for t, r in ranked]
        return {"token_id": token_id, "logprob": top[0]["logprob"], "top_logprobs": top}

    body = json.dumps(
        {
            "choices": [
                {
                    "token_ids": [5, 6, 7],
                    "finish_reason": "stop",
                    "sampling_mask": [[5, 8], [6], [7]],
                    "logprobs": {
                        "content": [
                            entry(5, [(5, 1), (8, 2), (9, 3)]),
                            entry(6, [(6, 7), (1, 1), (4, 2)]),
                            entry(7, [(7, 3), (2, 1), (0, 2)]),
                        ]
                    },
                }
            ]
        }
    ).encode()
    completion = parse_generate_response(body, num_top=2)
    assert completion.top_ids.tolist() == [[5, 8], [1, 4], [2, 0]]
    np.testing.assert_allclose(completion.top_logprobs, [[-0.1, -0.2]] * 3, rtol=1e-6)
    np.testing.assert_allclose(completion.logprobs, [-0.1, -0.7, -0.3], rtol=1e-6)
    assert [mask.tolist() for mask in completion.sampling_masks] == [[5, 8], [6], [7]]


def test_generate_endpoint_top_log_probs_without_ranks_are_refused():
    entry = {
        "token_id": 5,
        "logprob": -0.3,
        "top_logprobs": [{"token_id": 5, "logprob": -0.3}, {"token_id": 8, "logprob": -1.4}],
    }
    body = json.dumps({"choices": [{"token_ids": [5], "logprobs": {"content": [entry]}}]}).encode()
    with pytest.raises(MalformedResponseError, match="no ranks"):
        parse_generate_response(body, num_top=1)
