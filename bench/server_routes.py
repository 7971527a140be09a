"""Which generation route costs the server less: `/v1/completions` or `/inference/v1/generate`?

The worker asks for each token's top-N log-probs (score centering, N = 8 by default). Through
`/v1/completions` vLLM's API process decodes every one of them to text, which the worker never
reads; the token route (`--enable-scale-out`) returns token ids and skips that. On one server (the
tiny model, pinned to one core, the load on the other), 48 requests kept in flight, each 64 tokens
with 8 top log-probs: generated tokens per second on each route, and how long pause -> reload ->
resume takes under that load (what a weight sync stalls generation for).
Run: `.venv/bin/python bench/server_routes.py`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from asyncgrpo.cli.tiny_model import save_tiny_model
from asyncgrpo.generation.client import SamplingParams, VLLMClient
from asyncgrpo.generation.server import ServerOptions, VLLMServer

IN_FLIGHT = 48
MEASURE_S = 10.0
SYNCS = 15
SAMPLING = SamplingParams(max_tokens=64, temperature=1.0, num_top_logprobs=8)
PROMPT = [952, 648, 198, 287, 260, 294, 10]


async def keep_busy(client: VLLMClient, route: str, stop: asyncio.Event, generated: list[int]) -> None:
    """IN_FLIGHT requests at all times on `route` until `stop`; counts generated tokens."""
    call = getattr(client, route)

    async def one(index: int) -> None:
        seed = index
        while not stop.is_set():
            completion = await call([*PROMPT, 10 + index], SAMPLING, seed=seed)
            generated[0] += completion.num_tokens
            seed += IN_FLIGHT

    await asyncio.gather(*(one(index) for index in range(IN_FLIGHT)))


async def measure(url: str, weights_dir: str, route: str) -> tuple[float, list[float]]:
    """Tokens per second on `route`, and the stall of each pause -> reload -> resume under load."""
    async with VLLMClient(url, timeout=120) as client:
        stop, generated = asyncio.Event(), [0]
        load = asyncio.create_task(keep_busy(client, route, stop, generated))
        await asyncio.sleep(3.0)  # reach a steady state
        tokens, started = generated[0], time.perf_counter()
        await asyncio.sleep(MEASURE_S)
        rate = (generated[0] - tokens) / (time.perf_counter() - started)
        stalls = []
        for _ in range(SYNCS):
            await asyncio.sleep(0.3)
            paused = time.perf_counter()
            await client.pause(mode="keep")
            await client.reload_weights(weights_dir)
            await client.resume()
            stalls.append(time.perf_counter() - paused)
        stop.set()
        await load
    return rate, stalls


def main() -> None:
    cores = sorted(os.sched_getaffinity(0))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[0])
    os.sched_setaffinity(0, {cores[0]})  # the server's processes inherit this
    work = Path(tempfile.mkdtemp(prefix="server-routes-"))
    model_dir = save_tiny_model(work / "model")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    options = ServerOptions(model=str(model_dir), port=port, max_model_len=1024, dtype="float32", cpu=True)
    results = {}
    with VLLMServer(options, log_path=work / "vllm.log"):
        os.sched_setaffinity(0, {cores[-1]})
        for route in ("complete", "generate_tokens"):
            results[route] = asyncio.run(measure(options.url, str(model_dir), route))
    for route, (rate, stalls) in results.items():
        print(f"{route}: {rate:.0f} tokens/s; pause+reload+resume median {statistics.median(stalls):.3f} s, "
              f"mean {statistics.mean(stalls):.3f} s")  # fmt: skip
    speedup = results["generate_tokens"][0] / results["complete"][0]
    print(f"server_routes token_route_speedup={speedup:.2f} (no target: it decides the worker's route)")


if __name__ == "__main__":
    sys.exit(main())
