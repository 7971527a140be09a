"""Parsing speed of vLLM completion responses (512 tokens, top-8 log-probs each) into arrays.

The rollout worker parses every token the server generates: it must never be slower than vLLM.
Target: >= 200,000 generated tokens/s on one core. Run: `.venv/bin/python bench/client_parse.py`.
"""

from __future__ import annotations

import json
import os
import random
import time

from asyncgrpo.generation.responses import parse_completion_response

NUM_TOKENS = 512
TOP_N = 8
VOCAB = 151_936
TARGET = 200_000


def vllm_shaped_response(rng: random.Random) -> bytes:
    """A `/v1/completions` body as vLLM 0.32 writes it with `return_tokens_as_token_ids`."""
    token_ids = [rng.randrange(VOCAB) for _ in range(NUM_TOKENS)]
    token_logprobs, top_logprobs = [], []
    for token in token_ids:
        sampled = -rng.random() * 3
        top = {f"token_id:{token}": sampled}
        while len(top) < TOP_N + (0 if rng.random() < 0.5 else 1):
            top[f"token_id:{rng.randrange(VOCAB)}"] = -rng.random() * 6
        token_logprobs.append(sampled)
        top_logprobs.append(top)
    choice = {
        "index": 0,
        "text": "x" * (NUM_TOKENS * 4),
        "logprobs": {
            "text_offset": list(range(0, NUM_TOKENS * 12, 12)),
            "token_logprobs": token_logprobs,
            "tokens": [f"token_id:{token}" for token in token_ids],
            "top_logprobs": top_logprobs,
        },
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": token_ids,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
    }
    body = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m", "choices": [choice]}
    body["usage"] = {"prompt_tokens": 300, "completion_tokens": NUM_TOKENS, "total_tokens": 300 + NUM_TOKENS}
    return json.dumps(body, separators=(",", ":")).encode()  # compact, as vLLM writes it


def main() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    rng = random.Random(0)
    bodies = [vllm_shaped_response(rng) for _ in range(16)]
    for body in bodies:  # warm-up, and a check that the parse is complete
        completion = parse_completion_response(body, TOP_N)
        assert completion.num_tokens == NUM_TOKENS and completion.top_ids.shape == (NUM_TOKENS, TOP_N)
        assert (completion.top_ids >= 0).all()
    rounds = 30
    started = time.perf_counter()
    for _ in range(rounds):
        for body in bodies:
            parse_completion_response(body, TOP_N)
    elapsed = time.perf_counter() - started
    tokens_per_s = rounds * len(bodies) * NUM_TOKENS / elapsed
    print(f"{rounds * len(bodies)} responses of {NUM_TOKENS} tokens with top-{TOP_N} in {elapsed:.2f} s")
    print(f"client_parse tokens_per_s={tokens_per_s:.0f} target={TARGET}")


if __name__ == "__main__":
    main()
