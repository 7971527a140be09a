"""Rollout-worker throughput against a local server that answers instantly.

The worker process (pinned to one core) generates against a fake vLLM server (another process, on
another core) that returns 256-token completions with top-8 log-probs at once, scores them with a
trivial reward and queues samples, which this script (the "trainer") drains. The figure is
completions per second through the whole worker: HTTP, parsing, sequences, scoring, queueing.
Target: >= 500 completions/s (128k generated tokens/s) on one core.
Run: `.venv/bin/python bench/worker_throughput.py`.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import socket
import sys
import tempfile
import time

COMPLETION_TOKENS = 256
TOP_N = 8
TARGET = 500
MEASURE_S = 20.0


def constant_reward(completion_ids, **kwargs):
    return [float(len(ids) % 7) + random.random() for ids in completion_ids]


def fake_completion_body(rng: random.Random, vocab: int) -> bytes:
    token_ids = [rng.randrange(vocab) for _ in range(COMPLETION_TOKENS)]
    tops = []
    for token in token_ids:
        top = {f"token_id:{token}": -rng.random()}
        while len(top) < TOP_N + rng.randrange(2):
            top[f"token_id:{rng.randrange(vocab)}"] = -rng.random() * 5
        tops.append(top)
    choice = {
        "index": 0,
        "text": "",
        "logprobs": {
            "text_offset": list(range(COMPLETION_TOKENS)),
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


def run_fake_server(port: int, vocab: int, core: int) -> None:
    """An instant vLLM stand-in: /v1/models and /v1/completions; no /metrics (cap = the user's bound)."""
    from aiohttp import web

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    rng = random.Random(0)
    bodies = [fake_completion_body(rng, vocab) for _ in range(32)]
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


def main() -> None:
    from datasets import Dataset

    from asyncgrpo.cli.tiny_model import build_tokenizer
    from asyncgrpo.config import AsyncGRPOConfig
    from asyncgrpo.rollout.loop import AsyncRolloutLoop
    from asyncgrpo.rollout.worker import RolloutWorker

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    worker_core, other_core = cores[0], cores[-1]
    tokenizer = build_tokenizer()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = multiprocessing.get_context("spawn").Process(
        target=run_fake_server, args=(port, len(tokenizer), other_core), daemon=True
    )
    server.start()
    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"Question {i}?"}] for i in range(4096)]}
    )
    config = AsyncGRPOConfig(
        output_dir=tempfile.mkdtemp(),
        vllm_server_base_url=f"http://127.0.0.1:{port}",
        num_generations=8,
        max_completion_length=COMPLETION_TOKENS,
        max_concurrent_rollouts=256,
        report_to="none",
    )
    worker = RolloutWorker(
        AsyncRolloutLoop,
        dict(
            config=config,
            model_name="fake",
            dataset=dataset,
            reward_funcs=[constant_reward],
            processing_class=tokenizer,
            eos_token_ids=[tokenizer.eos_token_id],
        ),
        initial_allowance=1e15,
        worker_timeout=120,
    )
    # The worker inherits the affinity of this process at spawn: one core for it alone.
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {worker_core})
    worker.start(ready_timeout=120)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {other_core})
    try:
        completions = 0
        warm_until = time.monotonic() + 5.0
        while time.monotonic() < warm_until:
            worker.next_result(timeout=1.0)
        started = time.monotonic()
        while time.monotonic() - started < MEASURE_S:
            result = worker.next_result(timeout=1.0)
            if result is not None:
                completions += len(result.samples)
        elapsed = time.monotonic() - started
    finally:
        worker.stop()
        server.terminate()
    rate = completions / elapsed
    print(
        f"worker core {worker_core}, fake server and trainer on core {other_core}; "
        f"{completions} completions of {COMPLETION_TOKENS} tokens with top-{TOP_N} in {elapsed:.1f} s "
        f"({rate * COMPLETION_TOKENS:.0f} generated tokens/s)"
    )
    print(f"worker completions_per_s={rate:.0f} target={TARGET}")


if __name__ == "__main__":
    sys.exit(main())
