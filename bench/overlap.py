"""Does asynchrony pay? The async default vs a synchronous schedule, same model, data and server.

Synchronous (a benchmark mode): the server is paused while the trainer runs forward/backward, the
optimizer and the weight sync, so generation and training alternate; a step then costs generation
(`perf/rollout_wait_s`) plus training (the rest of `perf/step_s`). The async default overlaps them,
so its ideal step is max(generation, training) measured in the synchronous run.
Target: the async step within 10% of that ideal.

On the 2-core CPU machine, generation and training would compete for the same two cores, and the
ideal assumes they do not (on GPUs they run on different devices). So, standing in for separate
devices, the vLLM server is pinned to core 0 and the trainer (and the worker it spawns) to core 1
(`--shared-cores` runs them unpinned instead).
Run: `.venv/bin/python bench/overlap.py [--weight-sync-steps N] [--shared-cores]`.
"""

from __future__ import annotations

import argparse

import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from datasets import Dataset

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.generation.server import ServerOptions, VLLMServer
from asyncgrpo.tiny_model import save_tiny_model

STEPS = 24
WARMUP_STEPS = 4  # compilation and the first fill of the queue
TARGET = 1.10
# What holds generation back, per logging step (see README "Three limits on generation").
DIAGNOSTICS = (
    "rollout/generated_tokens_per_s", "rollout/concurrency", "rollout/concurrency_cap", "rollout/backpressure_s",
    "perf/weight_sync_s", "perf/weight_sync_pause_s", "sample/staleness_mean", "frac_zero_std_groups",
    "batch/samples_per_step",
)  # fmt: skip


def token_parity_reward(completion_ids, **kwargs):
    return [sum(1 for token in ids if token % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


class SynchronousTrainer(AsyncGRPOTrainer):
    """Generation stops while the trainer trains: the server is paused before forward/backward and
    resumed once the step (and its weight sync, if any) is done."""

    def _forward_backward(self, model, batch):
        self._http.run(self._client.pause(mode="keep"))
        return super()._forward_backward(model, batch)

    def _train_step(self, model) -> None:
        super()._train_step(model)
        self._http.run(self._client.resume())


def worker_on(trainer_class, cores: set[int]):
    """`trainer_class` with its rollout worker process pinned to `cores` once started."""

    class Pinned(trainer_class):
        def _setup_generation(self, args, rollout_state):
            super()._setup_generation(args, rollout_state)
            os.sched_setaffinity(self._worker.process.pid, cores)

    return Pinned


def run(trainer_class, server_url: str, model_dir: Path, output_dir: Path, weight_sync_steps: int) -> list[dict]:
    args = AsyncGRPOConfig(
        output_dir=str(output_dir),
        vllm_server_base_url=server_url,
        max_steps=STEPS,
        num_generations=8,
        max_completion_length=64,
        token_budget=1024,
        learning_rate=1e-5,
        gradient_checkpointing=False,
        weight_sync_steps=weight_sync_steps,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Tell me about {i}."}] for i in range(500)]})
    trainer = trainer_class(str(model_dir), token_parity_reward, args, train_dataset=dataset)
    trainer.train()
    return [entry for entry in trainer.state.log_history if "perf/step_s" in entry][WARMUP_STEPS:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shared-cores", action="store_true", help="server and trainer on the same cores")
    parser.add_argument("--weight-sync-steps", type=int, default=1, help="both schedules sync this often")
    parser.add_argument("--worker-with-server", action="store_true", help="the rollout worker on the server's core")
    cli = parser.parse_args()
    shared = cli.shared_cores
    torch.set_num_threads(1)  # the server needs the other core (see demo.py)
    cores = sorted(os.sched_getaffinity(0))
    server_cores, trainer_cores = ({cores[0]}, {cores[-1]}) if not shared and len(cores) > 1 else (set(cores),) * 2
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(server_cores)))
    os.sched_setaffinity(0, server_cores)  # the server's processes inherit this
    work = Path(tempfile.mkdtemp(prefix="overlap-"))
    model_dir = save_tiny_model(work / "model")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    options = ServerOptions(model=str(model_dir), port=port, max_model_len=1024, dtype="float32", cpu=True)
    with VLLMServer(options, log_path=work / "vllm.log"):
        os.sched_setaffinity(0, trainer_cores)  # the trainer, and the worker it spawns
        worker_cores = server_cores if cli.worker_with_server else trainer_cores
        synchronous = run(worker_on(SynchronousTrainer, worker_cores), options.url, model_dir, work / "sync", cli.weight_sync_steps)
        asynchronous = run(worker_on(AsyncGRPOTrainer, worker_cores), options.url, model_dir, work / "async", cli.weight_sync_steps)
    generation = statistics.mean(e["perf/rollout_wait_s"] for e in synchronous)
    training = statistics.mean(e["perf/step_s"] - e["perf/rollout_wait_s"] for e in synchronous)
    sync_step = statistics.mean(e["perf/step_s"] for e in synchronous)
    async_step = statistics.mean(e["perf/step_s"] for e in asynchronous)
    ideal = max(generation, training)
    print(f"synchronous: {sync_step:.3f} s/step = generation {generation:.3f} + training {training:.3f}")
    print(f"async:       {async_step:.3f} s/step (waiting {statistics.mean(e['perf/rollout_wait_s'] for e in asynchronous):.3f})")
    print(f"ideal async: {ideal:.3f} s/step = max(generation, training)")
    for name, history in (("synchronous", synchronous), ("async", asynchronous)):
        means = {key: statistics.mean(e[key] for e in history if key in e) for key in DIAGNOSTICS if any(key in e for e in history)}
        print(f"{name} means: " + ", ".join(f"{key}={value:.3g}" for key, value in means.items()))
    print(f"server on cores {sorted(server_cores)}, trainer on {sorted(trainer_cores)}, worker on {sorted(worker_cores)}, "
          f"a weight sync every {cli.weight_sync_steps} step(s)")
    print(f"overlap async_step_s={async_step:.3f} sync_step_s={sync_step:.3f} ideal_s={ideal:.3f} "
          f"ratio={async_step / ideal:.2f} target={TARGET:.2f}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
