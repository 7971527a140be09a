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
It also prints each vLLM process's share of the server's core over the measured steps: only the
model runner stands for the GPU (bench/RESULTS.md says why that matters here).
Run: `.venv/bin/python bench/overlap.py [--weight-sync-steps N] [--steps N] [--shared-cores]`.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.cli.tiny_model import save_tiny_model
from asyncgrpo.generation.server import ServerOptions, VLLMServer

WARMUP_STEPS = 4  # compilation and the first fill of the queue
TARGET = 1.10
# What holds generation back, per logging step (see README "Three limits on generation").
DIAGNOSTICS = (
    "rollout/generated_tokens_per_s", "rollout/concurrency", "rollout/concurrency_cap",
    "rollout/backpressure_s",
    "perf/weight_sync_s", "perf/weight_sync_pause_s", "sample/staleness_mean", "frac_zero_std_groups",
    "batch/samples_per_step",
)  # fmt: skip


def process_tree(root: int) -> list[int]:
    """`root` and every process below it (Linux /proc)."""
    pids, index = [root], 0
    while index < len(pids):
        for task in os.listdir(f"/proc/{pids[index]}/task"):
            with open(f"/proc/{pids[index]}/task/{task}/children") as children:
                pids += [int(pid) for pid in children.read().split()]
        index += 1
    return pids


def cpu_seconds_by_process(root: int) -> dict[str, float]:
    """CPU seconds used so far by each process of the server's tree, by name (API server, engine
    core, model runner)."""
    ticks = os.sysconf("SC_CLK_TCK")
    usage: dict[str, float] = {}
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/comm") as comm:
                name = comm.read().strip()
        except OSError:  # exited meanwhile
            continue
        name = {"python": "api_server"}.get(name, name.removeprefix("VLLM::").lower())
        usage[name] = usage.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return usage


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


def run(
    trainer_class,
    server_url: str,
    model_dir: Path,
    output_dir: Path,
    weight_sync_steps: int,
    steps: int,
    meter,
):
    """The logs of the measured steps."""
    args = AsyncGRPOConfig(
        output_dir=str(output_dir),
        vllm_server_base_url=server_url,
        max_steps=steps,
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
    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"Tell me about {i}."}] for i in range(500)]}
    )
    trainer = trainer_class(
        str(model_dir), token_parity_reward, args, train_dataset=dataset, callbacks=[meter]
    )
    trainer.train()
    return [entry for entry in trainer.state.log_history if "perf/step_s" in entry][WARMUP_STEPS:]


class ServerCpuMeter(TrainerCallback):
    """Each server process's share of one core over the measured steps (after the warm-up)."""

    def __init__(self, server_pid: int):
        self.server_pid = server_pid
        self.shares: dict[str, float] = {}

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == WARMUP_STEPS:
            self._before, self._started = cpu_seconds_by_process(self.server_pid), time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        after, elapsed = cpu_seconds_by_process(self.server_pid), time.perf_counter() - self._started
        self.shares = {name: (after[name] - self._before.get(name, 0.0)) / elapsed for name in after}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shared-cores", action="store_true", help="server and trainer on the same cores")
    parser.add_argument("--weight-sync-steps", type=int, default=1, help="both schedules sync this often")
    parser.add_argument(
        "--worker-with-server", action="store_true", help="the rollout worker on the server's core"
    )
    parser.add_argument(
        "--steps", type=int, default=24, help=f"steps per schedule (the first {WARMUP_STEPS} not measured)"
    )
    cli = parser.parse_args()
    shared = cli.shared_cores
    torch.set_num_threads(1)  # the server needs the other core (see demo.py)
    cores = sorted(os.sched_getaffinity(0))
    server_cores, trainer_cores = (
        ({cores[0]}, {cores[-1]}) if not shared and len(cores) > 1 else (set(cores),) * 2
    )
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(server_cores)))
    os.sched_setaffinity(0, server_cores)  # the server's processes inherit this
    work = Path(tempfile.mkdtemp(prefix="overlap-"))
    model_dir = save_tiny_model(work / "model")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    options = ServerOptions(model=str(model_dir), port=port, max_model_len=1024, dtype="float32", cpu=True)
    with VLLMServer(options, log_path=work / "vllm.log") as server:
        os.sched_setaffinity(0, trainer_cores)  # the trainer, and the worker it spawns
        worker_cores = server_cores if cli.worker_with_server else trainer_cores
        sync_cpu, async_cpu = ServerCpuMeter(server.process.pid), ServerCpuMeter(server.process.pid)
        synchronous = run(
            worker_on(SynchronousTrainer, worker_cores),
            options.url,
            model_dir,
            work / "sync",
            cli.weight_sync_steps,
            cli.steps,
            sync_cpu,
        )
        asynchronous = run(worker_on(AsyncGRPOTrainer, worker_cores), options.url, model_dir, work / "async",
                           cli.weight_sync_steps, cli.steps, async_cpu)  # fmt: skip
    generation = statistics.mean(e["perf/rollout_wait_s"] for e in synchronous)
    training = statistics.mean(e["perf/step_s"] - e["perf/rollout_wait_s"] for e in synchronous)
    sync_step = statistics.mean(e["perf/step_s"] for e in synchronous)
    async_step = statistics.mean(e["perf/step_s"] for e in asynchronous)
    ideal = max(generation, training)
    print(f"synchronous: {sync_step:.3f} s/step = generation {generation:.3f} + training {training:.3f}")
    print(
        f"async:       {async_step:.3f} s/step "
        f"(waiting {statistics.mean(e['perf/rollout_wait_s'] for e in asynchronous):.3f})"
    )
    print(f"ideal async: {ideal:.3f} s/step = max(generation, training)")
    for name, history in (("synchronous", synchronous), ("async", asynchronous)):
        means = {
            key: statistics.mean(e[key] for e in history if key in e)
            for key in DIAGNOSTICS
            if any(key in e for e in history)
        }
        print(f"{name} means: " + ", ".join(f"{key}={value:.3g}" for key, value in means.items()))
    # Where the server's core goes: only the model runner stands for the GPU; the API server and the
    # engine core would have CPU cores of their own on a GPU host.
    for name, meter in (("synchronous", sync_cpu), ("async", async_cpu)):
        print(
            f"{name} server core shares: "
            + ", ".join(f"{key}={value:.0%}" for key, value in sorted(meter.shares.items()))
        )
    print(
        f"server on cores {sorted(server_cores)}, trainer on {sorted(trainer_cores)}, "
        f"worker on {sorted(worker_cores)}, "
        f"a weight sync every {cli.weight_sync_steps} step(s)"
    )
    print(f"overlap async_step_s={async_step:.3f} sync_step_s={sync_step:.3f} ideal_s={ideal:.3f} "
          f"ratio={async_step / ideal:.2f} target={TARGET:.2f}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
