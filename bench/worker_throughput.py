"""Rollout-worker throughput against a local server that answers instantly.

The worker process (pinned to one core) generates against a fake vLLM server (another process, on
another core) that returns 256-token completions with top-8 log-probs at once, scores them with a
trivial reward and queues samples, which this script (the "trainer") drains. The figure is
completions per second through the whole worker: HTTP, parsing, sequences, scoring, queueing.
Target: >= 500 completions/s (128k generated tokens/s) on one core. With `--workers K`, K worker
processes (num_rollout_workers), each on its own core with its own fake server where there are cores
enough; targets: >= 1.7x from 1 to 2 workers, >= 1M generated tokens/s with 8 workers on 16 cores.
Run: `.venv/bin/python bench/worker_throughput.py [--workers K]`.
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
# Spawning a worker imports torch and transformers: on a loaded machine that alone can take minutes.
READY_TIMEOUT_S = 600.0


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
    import argparse

    from datasets import Dataset

    from asyncgrpo.cli.tiny_model import build_tokenizer
    from asyncgrpo.config import AsyncGRPOConfig
    from asyncgrpo.rollout.loop import AsyncRolloutLoop
    from asyncgrpo.rollout.worker import RolloutWorkerPool

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workers", type=int, default=1, help="rollout worker processes (num_rollout_workers)"
    )
    workers = parser.parse_args().workers
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    # A core per worker where there are enough; the fake servers (one per worker, so that the server
    # side is never the bottleneck) and this script share the cores left, or the last one.
    worker_cores = [cores[k % len(cores)] for k in range(workers)]
    other_cores = cores[workers:] or cores[-1:]
    tokenizer = build_tokenizer()
    urls, servers = [], []
    for index in range(workers):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        server = multiprocessing.get_context("spawn").Process(
            target=run_fake_server,
            args=(port, len(tokenizer), other_cores[index % len(other_cores)]),
            daemon=True,
        )
        server.start()
        servers.append(server)
        urls.append(f"http://127.0.0.1:{port}")
    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"Question {i}?"}] for i in range(4096)]}
    )
    config = AsyncGRPOConfig(
        output_dir=tempfile.mkdtemp(),
        vllm_server_base_url=urls,
        num_generations=8,
        max_completion_length=COMPLETION_TOKENS,
        max_concurrent_rollouts=256,
        num_rollout_workers=workers,
        report_to="none",
    )
    pool = RolloutWorkerPool(
        AsyncRolloutLoop,
        dict(
            config=config,
            model_name="fake",
            dataset=dataset,
            reward_funcs=[constant_reward],
            processing_class=tokenizer,
            eos_token_ids=[tokenizer.eos_token_id],
        ),
        num_workers=workers,
        initial_allowance=1e15,
        worker_timeout=120,
    )
    # A worker inherits the affinity of this process at spawn: each gets its core.
    deadline = time.monotonic() + READY_TIMEOUT_S
    for worker, core in zip(pool.workers, worker_cores):
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {core})
        worker.spawn()
    for worker in pool.workers:
        worker.start_generating(deadline, READY_TIMEOUT_S)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(other_cores))
    try:
        completions = 0
        warm_until = time.monotonic() + 5.0
        while time.monotonic() < warm_until:
            pool.next_result(timeout=1.0)
        started = time.monotonic()
        while time.monotonic() - started < MEASURE_S:
            result = pool.next_result(timeout=1.0)
            if result is not None:
                completions += len(result.samples)
        elapsed = time.monotonic() - started
    finally:
        pool.stop()
        for server in servers:
            server.terminate()
    rate = completions / elapsed
    print(
        f"workers on cores {worker_cores}, fake servers and trainer on {other_cores}; "
        f"{completions} completions of {COMPLETION_TOKENS} tokens with top-{TOP_N} in {elapsed:.1f} s "
        f"({rate * COMPLETION_TOKENS:.0f} generated tokens/s)"
    )
    print(f"worker_scaling workers={workers} tokens_per_s={rate * COMPLETION_TOKENS:.0f}")
    if workers == 1:
        print(f"worker completions_per_s={rate:.0f} target={TARGET}")


if __name__ == "__main__":
    sys.exit(main())
