"""Rollout-worker throughput against a local server that answers instantly.

The worker process (pinned to one core) generates against a fake vLLM server (another process, on
another core) that returns 256-token completions with top-8 log-probs at once, scores them with a
trivial reward and queues samples, which this script (the "trainer") drains. The figure is
completions per second through the whole worker: HTTP, parsing, sequences, scoring, queueing.
Target: >= 500 completions/s (128k generated tokens/s) on one core. With `--workers K`, K worker
processes (num_rollout_workers), each on its own core with its own fake server where there are cores
enough; targets: >= 1.7x from 1 to 2 workers, >= 1M generated tokens/s with 8 workers on 16 cores.
It also prints the CPU time each process spent while measuring (`cpu_s`, and per completion
`cpu_us_per_completion`): the workers, the fake servers and this script (`drain`).
Run: `.venv/bin/python bench/worker_throughput.py [--workers K]`.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from pathlib import Path

COMPLETION_TOKENS = 256
TOP_N = 8
TARGET = 500
MEASURE_S = 20.0
# Spawning a worker imports torch and transformers: on a loaded machine that alone can take minutes.
READY_TIMEOUT_S = 600.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # After the command name: utime and stime are the 12th and 13th fields (proc(5)), in clock ticks.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(processes: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in processes.items()}


def constant_reward(completion_ids, **kwargs):
    return [float(len(ids) % 7) + random.random() for ids in completion_ids]


def main() -> None:
    import argparse

    from datasets import Dataset

    from asyncgrpo.cli.tiny_model import build_tokenizer
    from asyncgrpo.config import AsyncGRPOConfig
    from asyncgrpo.rollout.loop import AsyncRolloutLoop
    from asyncgrpo.rollout.worker import RolloutWorkerPool, worker_inputs

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from instant_vllm import start_instant_server

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workers", type=int, default=1, help="rollout worker processes (num_rollout_workers)"
    )
    workers = parser.parse_args().workers
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    # A core per worker where there are enough; the fake servers (one per worker, so that the server
    # side is never the bottleneck) and this script share the cores left. With no core left they may
    # run on any: pinned to one, they took all their CPU from the one worker there.
    worker_cores = [cores[k % len(cores)] for k in range(workers)]
    other_cores = cores[workers:] or cores
    tokenizer = build_tokenizer()
    urls, servers = [], []
    for index in range(workers):
        url, server = start_instant_server(
            len(tokenizer), COMPLETION_TOKENS, TOP_N, core=other_cores[index % len(other_cores)]
        )
        servers.append(server)
        urls.append(url)
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
        worker_inputs(
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
        # Where the CPU goes while measuring: each worker, each fake server and this process (the
        # "trainer": the threads that receive and unpickle the results, and this loop).
        processes = {f"worker{k}": worker.process.pid for k, worker in enumerate(pool.workers)}
        processes.update({f"server{k}": server.pid for k, server in enumerate(servers)})
        processes["drain"] = os.getpid()
        cpu_before = cpu_snapshot(processes)
        started = time.monotonic()
        while time.monotonic() - started < MEASURE_S:
            result = pool.next_result(timeout=1.0)
            if result is not None:
                completions += len(result.samples)
        elapsed = time.monotonic() - started
        cpu_after = cpu_snapshot(processes)
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
    spent = {name: cpu_after[name] - cpu_before[name] for name in processes}
    print("cpu_s " + " ".join(f"{name}={seconds:.1f}" for name, seconds in spent.items()))
    if completions:
        per_completion = {name: 1e6 * seconds / completions for name, seconds in spent.items()}
        print("cpu_us_per_completion " + " ".join(f"{n}={us:.0f}" for n, us in per_completion.items()))
    print(f"worker_scaling workers={workers} tokens_per_s={rate * COMPLETION_TOKENS:.0f}")
    if workers == 1:
        print(f"worker completions_per_s={rate:.0f} target={TARGET}")


if __name__ == "__main__":
    sys.exit(main())
