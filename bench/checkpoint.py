"""Checkpoint saves of a model of Qwen3-0.6B's shape (random weights, AdamW moments) on two training
processes (torchrun, gloo, CPU), FSDP2-sharded as the trainer shards it.

- `full_gather_gb` (B): how much rank 0's resident memory grows during the save the trainer made before
  sharded checkpoints (`checkpoint_format="full"`): every rank gathers the whole model and optimizer,
  rank 0 receives them and writes model.safetensors and optimizer.pt.
- `rank0_peak_gb` (A): the same during a sharded save written in the background (the staged copy of
  rank 0's own shards, then the writer's buffers), until it is durable.
- `stall_s` (C): the seconds a background sharded save holds the training: starting it (the staging
  directory, the views of every shard), the wait of the next step's update for what is left of the copy
  of the shards out of the live tensors (copied in a thread while the next step's forward and backward
  run), the checks at each step's end of whether it finished, and any wait for it once `--steps`
  training steps have run beside it. It is a run's first save, the slowest to copy: it allocates the
  staging memory (kept for the run's later saves), touching every page of it for the first time.
- `sync_save_s` (D): a synchronous sharded save, from its start until it is durable (every file
  flushed, renamed into place).

Memory is each phase's peak (VmHWM, reset before the phase) minus the resident memory before it, so it
counts what the save itself takes; the steps beside the background save run in a phase of their own.
Targets: A <= 0.6 B (rank 0 holds about its own shard, not the whole state), C <= 0.1 D.

Run (about 10 GiB of memory in float32, and 8 GB of disk at a time under --out):
`.venv/bin/python bench/checkpoint.py [--dtype float32] [--steps 3] [--layers 28] [--out DIR]`; it
starts itself under torchrun. Last line:
`checkpoint_save rank0_peak_gb=A full_gather_gb=B stall_s=C sync_save_s=D`.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from asyncgrpo.checkpoints.background import ShardedWriter  # noqa: E402
from asyncgrpo.checkpoints.layout import SHARDS_DIR, ShardedManifest  # noqa: E402
from asyncgrpo.checkpoints.sharded_state import tied_aliases, training_state  # noqa: E402
from asyncgrpo.run.durable_files import fsync_tree, staging_path  # noqa: E402
from asyncgrpo.trainer.checkpoint_saves import publish_sharded  # noqa: E402
from asyncgrpo.trainer.distributed import Processes, full_state, shard_model  # noqa: E402

GB = 1e9


def qwen3_0_6b(dtype: torch.dtype, layers: int) -> Qwen3ForCausalLM:
    """Qwen3-0.6B's configuration, random weights, built on no device and sharded before any weight
    exists, so that no process ever holds the whole model."""
    config = Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        max_position_embeddings=40960, rope_theta=1_000_000.0, dtype=dtype,
    )  # fmt: skip
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config).to(dtype)
    shard_model(model)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(dist.get_rank())
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            local = parameter.to_local()
            if "norm" in name:
                local.fill_(1.0)
            else:
                local.copy_(torch.randn(local.shape, generator=generator) * 0.02)
    model.model.rotary_emb.__init__(config)  # its buffers, computed rather than loaded
    return model


def resident() -> tuple[float, float]:
    """(resident now, peak since the last reset) of this process, in GB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":")
            fields[key] = int(value.split()[0]) * 1024 / GB
    return fields["VmRSS"], fields["VmHWM"]


def begin_phase() -> float:
    """Memory freed by the phase before given back, the peak reset; returns the resident GB."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    return resident()[0]


def growth(before: float) -> float:
    return resident()[1] - before


def train_step(model, optimizer, batch, writer: ShardedWriter | None = None) -> float:
    """One step; returns the seconds it waited for a background save's copy before its update."""
    model(input_ids=batch, labels=batch).loss.backward()
    waited = writer.wait_for_copy() if writer is not None else 0.0
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return waited


def start_sharded(writer, model, optimizer, destination: Path, processes: Processes) -> float:
    """A sharded save of the step, started as the trainer starts one (the staging directory, every
    rank's state, the copy); returns the seconds it held the caller."""
    started = time.perf_counter()
    staging = staging_path(destination)
    if processes.is_main:
        staging.mkdir(parents=True)
    processes.gather(None)
    manifest = ShardedManifest(
        step=1, world_size=processes.world_size, holds_optimizer=True,
        dtype=str(model.dtype).removeprefix("torch."), aliases=tied_aliases(model),
    )  # fmt: skip
    publish = None
    if processes.is_main:

        def publish() -> None:
            publish_sharded(staging, destination, manifest, None, None, None, None)

    writer.start(1, training_state(model, optimizer, trainable_only=False), staging / SHARDS_DIR, publish)
    return time.perf_counter() - started


def full_save(model, optimizer, destination: Path, processes: Processes) -> None:
    """The full layout's save: the whole model and optimizer gathered, rank 0 writing them."""
    model_state, optimizer_state = full_state(model, optimizer)
    if processes.is_main:
        destination.mkdir(parents=True)
        aliases = tied_aliases(model)
        save_file(
            {k: v.contiguous() for k, v in model_state.items() if k not in aliases},
            destination / "model.safetensors",
        )
        torch.save(optimizer_state, destination / "optimizer.pt")
        fsync_tree(destination)
    del model_state, optimizer_state
    processes.gather(None)


def settled(writer: ShardedWriter) -> float:
    """Waits for the save in flight; its seconds from start to durable."""
    result = writer.settle(wait=True)
    assert result is not None and result.error is None, result
    return result.seconds


def phase_growth(name: str, save, written: Path, processes: Processes) -> float:
    """How much rank 0's resident memory grew during `save()` (GB); what it wrote is removed after."""
    before = begin_phase()
    started = time.perf_counter()
    save()
    grown = growth(before)
    if processes.is_main:
        print(
            f"{name}: rank 0 grew {grown:.2f} GB above {before:.2f} GB, {time.perf_counter() - started:.1f} s"
        )
        shutil.rmtree(written)
    return grown


def stall_beside_training(
    writer, model, optimizer, batch, out: Path, steps: int, processes: Processes
) -> float:
    """C: the seconds a background save holds training steps that run while it is written."""
    begin_phase()
    started = time.perf_counter()
    for _ in range(steps):
        train_step(model, optimizer, batch)
    quiet_step_s = (time.perf_counter() - started) / steps
    stall = started_s = start_sharded(writer, model, optimizer, out / "checkpoint-1", processes)
    beside, result, copy_wait = 0, None, 0.0
    started = time.perf_counter()
    while result is None and beside < steps:
        copy_wait += train_step(model, optimizer, batch, writer)
        beside += 1
        dist.barrier()  # the trainer's steps end together (its per-step broadcasts): skew is not the save's
        checked = time.perf_counter()
        result = writer.settle(wait=False)
        stall += time.perf_counter() - checked
    stall += copy_wait
    busy_step_s = (time.perf_counter() - started) / beside
    if result is None:
        waited = time.perf_counter()
        settled(writer)
        stall += time.perf_counter() - waited
    elif result.error is not None:
        raise RuntimeError(result.error)
    if processes.is_main:
        print(
            f"background save beside {beside} training step(s): starting it held the step {started_s:.2f} s, "
            f"the update waited {copy_wait:.2f} s for the copy, {stall:.2f} s in all; a step took "
            f"{busy_step_s:.1f} s beside the writer, {quiet_step_s:.1f} s without"
        )
        shutil.rmtree(out)
    return stall


def run(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    processes = Processes(dist.get_world_size(), dist.get_rank())
    dtype = getattr(torch, args.dtype)
    out = Path(args.out)
    model = qwen3_0_6b(dtype, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = torch.randint(0, 151936, (1, 16), generator=torch.Generator().manual_seed(0))
    train_step(model, optimizer, batch)  # the moments exist, as in a run
    log = print if processes.is_main else (lambda *a, **k: None)
    parameters = sum(p.numel() for p in model.parameters())
    log(
        f"model: {parameters / 1e9:.3f}B parameters in {args.dtype}, 2 processes; "
        f"rank 0 holds {resident()[0]:.2f} GB"
    )

    # A: a background sharded save, nothing else running.
    writer = ShardedWriter(processes, asynchronous=True)

    def background_save() -> None:
        start_sharded(writer, model, optimizer, out / "async" / "checkpoint-1", processes)
        settled(writer)

    peak_sharded = phase_growth("sharded background save", background_save, out / "async", processes)
    writer.close()  # its staging memory given back: C starts from none, as a run's first save does

    # D: a synchronous sharded save's whole time.
    sync_writer = ShardedWriter(processes, asynchronous=False)
    begin_phase()
    started = time.perf_counter()
    start_sharded(sync_writer, model, optimizer, out / "sync" / "checkpoint-1", processes)
    settled(sync_writer)
    sync_s = time.perf_counter() - started
    log(f"sharded synchronous save: {sync_s:.1f} s")
    if processes.is_main:
        shutil.rmtree(out / "sync")

    writer = ShardedWriter(processes, asynchronous=True)
    stall = stall_beside_training(writer, model, optimizer, batch, out / "overlap", args.steps, processes)
    writer.close()  # the staging memory given back, as at the end of a run

    # B: the full layout's gathered save.
    def gathered_save() -> None:
        full_save(model, optimizer, out / "full" / "checkpoint-1", processes)

    peak_full = phase_growth("full gathered save", gathered_save, out / "full", processes)

    measured = processes.gather((peak_sharded, peak_full, stall, sync_s))[0]
    if processes.is_main:
        a, b, c, d = measured
        print(
            f"targets: rank0_peak_gb <= 0.6 * full_gather_gb ({a <= 0.6 * b}), "
            f"stall_s <= 0.1 * sync_save_s ({c <= 0.1 * d})"
        )
        print(
            f"checkpoint_save rank0_peak_gb={a:.2f} full_gather_gb={b:.2f} stall_s={c:.2f} "
            f"sync_save_s={d:.1f}"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=3, help="training steps beside the background save")
    parser.add_argument("--layers", type=int, default=28, help="decoder layers (Qwen3-0.6B: 28)")
    parser.add_argument(
        "--out", default=None, help="where the checkpoints go (default: a temporary directory)"
    )
    args = parser.parse_args()
    if "RANK" in os.environ:
        run(args)
        return
    with tempfile.TemporaryDirectory(dir=args.out) as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", __file__]
        command += [
            "--dtype",
            args.dtype,
            "--steps",
            str(args.steps),
            "--layers",
            str(args.layers),
            "--out",
            out,
        ]
        environment = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        sys.exit(subprocess.run(command, env=environment).returncode)


if __name__ == "__main__":
    main()
