"""A teacher's scoring request against one idle CPU server of the tiny model: milliseconds for a 40-token
sequence scored teacher-forced (`prompt_logprobs`, top-8 and top-0, 20 positions read; through the token
route and, top-8, through `/v1/completions`, whose reports must agree), next to a one-token generation,
ten in a row and sixteen at once. What a teacher costs when it has its cores to
itself (bench/distillation.py measures it beside a student, a trainer and a worker). Run under the
machine's heavy-job lock: `.venv/bin/python bench/teacher_latency.py`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import time

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def measure(url: str) -> None:
    from asyncgrpo.generation.client import SamplingParams
    from asyncgrpo.generation.teacher_client import TeacherClient

    async with TeacherClient(url, timeout=60) as client:
        ids = [int(i) for i in np.random.default_rng(0).integers(3, 900, 40)]
        positions = np.arange(20, 40)
        await client.prompt_logprobs(ids, positions, 8, 1.0)  # the first request warms the server up
        completions = TeacherClient(url, timeout=60)
        completions._token_route = False  # the route a server without --enable-scale-out offers
        tokens_route = await client.prompt_logprobs(ids, positions, 8, 1.0)
        completions_route = await completions.prompt_logprobs(ids, positions, 8, 1.0)
        assert (tokens_route[0] == completions_route[0]).all(), "the two routes report other tokens"
        assert np.allclose(tokens_route[1], completions_route[1]), "the two routes report other log-probs"
        requests = {
            "prompt_logprobs_top8": lambda: client.prompt_logprobs(ids, positions, 8, 1.0),
            "prompt_logprobs_top8_completions_route": lambda: completions.prompt_logprobs(
                ids, positions, 8, 1.0
            ),
            "prompt_logprobs_top0": lambda: client.prompt_logprobs(ids, positions, 0, 1.0),
            "generate_1_token": lambda: client.complete(ids, SamplingParams(max_tokens=1), seed=0),
        }
        for name, request in requests.items():
            started = time.perf_counter()
            for _ in range(10):
                await request()
            sequential_ms = (time.perf_counter() - started) / 10 * 1000
            started = time.perf_counter()
            await asyncio.gather(*(request() for _ in range(16)))
            concurrent_ms = (time.perf_counter() - started) * 1000
            print(
                f"teacher_latency {name} sequential_ms={sequential_ms:.1f} "
                f"concurrent16_ms={concurrent_ms:.1f}"
            )
        await completions.close()


def main() -> int:
    from asyncgrpo.cli.tiny_model import save_tiny_model
    from asyncgrpo.generation.server import ServerOptions, VLLMServer

    work = tempfile.mkdtemp(prefix="asyncgrpo-teacher-latency-")
    model = save_tiny_model(os.path.join(work, "model"))
    options = ServerOptions(model=str(model), port=free_port(), max_model_len=1024, dtype="float32", cpu=True)
    server = VLLMServer(options, log_path=os.path.join(work, "vllm.log"))
    server.start()
    try:
        asyncio.run(measure(options.url))
    finally:
        server.stop()
    print(f"[teacher_latency] load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
