"""A vLLM stand-in that answers at once: /v1/models and /v1/completions with random token ids and
top-N log-probs, as vLLM's token route writes them. It takes the server's cost out of a measurement
(bench/worker_throughput.py) or out of a test of the rollout side (tests/test_worker_pool_resume.py).
It has no /metrics, so a worker's concurrency cap stays the user's bound."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import socket

# Distinct bodies served in turn: enough that consecutive completions differ.
DISTINCT_BODIES = 32


def fake_completion_body(rng: random.Random, vocab: int, completion_tokens: int, top_n: int) -> bytes:
    token_ids = [rng.randrange(vocab) for _ in range(completion_tokens)]
    tops = []
    for token in token_ids:
        top = {f"token_id:{token}": -rng.random()}
        while len(top) < top_n + rng.randrange(2):
            top[f"token_id:{rng.randrange(vocab)}"] = -rng.random() * 5
        tops.append(top)
    choice = {
        "index": 0,
        "text": "",
        "logprobs": {
            "text_offset": list(range(completion_tokens)),
            "token_logprobs": [next(iter(top.values())) for top in tops],
            "tokens": [f"token_id:{t}" for t in token_ids],
            "top_logprobs": tops,
        },
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": token_ids,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
    }
    body = {"id": "cmpl", "object": "text_completion", "model": "m", "choices": [choice]}
    return json.dumps(body, separators=(",", ":")).encode()  # compact, as vLLM writes it


def run_instant_server(port: int, vocab: int, completion_tokens: int, top_n: int, core: int | None) -> None:
    """Serve on `port` until killed (pinned to `core` when given)."""
    from aiohttp import web

    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    rng = random.Random(0)
    bodies = [fake_completion_body(rng, vocab, completion_tokens, top_n) for _ in range(DISTINCT_BODIES)]
    counter = iter(range(10**12))

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=bodies[next(counter) % len(bodies)], content_type="application/json")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake", "max_model_len": 4096}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def start_instant_server(
    vocab: int, completion_tokens: int, top_n: int, core: int | None = None
) -> tuple[str, multiprocessing.Process]:
    """(its URL, its process): a daemon process, so it dies with the caller at worst."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = multiprocessing.get_context("spawn").Process(
        target=run_instant_server, args=(port, vocab, completion_tokens, top_n, core), daemon=True
    )
    process.start()
    return f"http://127.0.0.1:{port}", process
