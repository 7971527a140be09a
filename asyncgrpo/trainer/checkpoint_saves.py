"""One run's checkpoints: the layout it writes, its saves in flight, and the failed ones retried.

`begin_run` (trainer/run_setup.py) makes a `RunCheckpoints`; the training loop calls `save` where the
schedule asks (every rank), `before_optimizer_step` (a background save's copy of the weights is taken
before they change), `check` at every step's end (a save in flight is settled once every rank has
written its part), `finish` when training ends and `close` in any case. The layouts
(asyncgrpo/checkpoints/layout.py):

- sharded: rank 0 writes the small files (config, tokenizer, trainer and rollout states) at once,
  every rank writes its shards of the model and optimizer, in the background unless
  `checkpoint_async=False`, and rank 0 renames the checkpoint into place once all are on the disk;
- full: every rank helps gather the states and rank 0 writes them, while the step waits
  (trainer/checkpoint.py).

Either way a checkpoint counts only once complete and durable, older ones are rotated away only then,
and a failed save is retried (asyncgrpo/checkpoints/failures.py).
"""

from __future__ import annotations

import logging
import shutil
import time
from functools import partial
from pathlib import Path
from typing import Callable

from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from asyncgrpo.checkpoints.background import SaveResult, ShardedWriter
from asyncgrpo.checkpoints.failures import FailedSaves
from asyncgrpo.checkpoints.layout import SHARDED, SHARDS_DIR, ShardedManifest
from asyncgrpo.checkpoints.sharded_state import tied_aliases, training_state
from asyncgrpo.records.metrics import MetricsWindow, Reduce
from asyncgrpo.run.durable_files import fsync_path, publish_directory, staging_path
from asyncgrpo.run.lock import DirectoryInUseError, OwnerLock
from asyncgrpo.trainer.checkpoint import (
    ResumePoint,
    note_best_checkpoint,
    refuse_if_taken_over,
    write_full_checkpoint,
    write_sharded_run_files,
)
from asyncgrpo.trainer.distributed import Processes
from asyncgrpo.trainer.optimizer_step import torch_optimizer

logger = logging.getLogger(__name__)


class RunCheckpoints:
    """The checkpoints of one train() call. `layout`: SHARDED or FULL; `asynchronous`: sharded saves
    are written in the background; `model_sharded`: the model is sharded with FSDP2 (a full save
    gathers it); `lock`: the run directory's (rank 0)."""

    def __init__(
        self,
        processes: Processes,
        layout: str,
        asynchronous: bool,
        model_sharded: bool,
        window: MetricsWindow,
        lock: OwnerLock | None,
    ):
        self.processes = processes
        self.layout = layout
        self.model_sharded = model_sharded
        self.window = window
        self.lock = lock
        self.writer = ShardedWriter(processes, asynchronous) if layout == SHARDED else None
        self.failures = FailedSaves()
        self._staging: dict[int, Path] = {}  # step -> staging directory of the sharded save in flight
        self._held: float | None = None  # seconds the last save held the step, its copy's wait to come

    @property
    def retry_due(self) -> bool:
        """A save failed: the next step saves again, whatever the schedule says."""
        return self.failures.retry_due

    def save(self, trainer: Trainer, model, trial, resume: ResumePoint, final: bool = False) -> None:
        """A checkpoint of the current step (every rank). `final`: the end of training's retry."""
        started = time.perf_counter()
        self._record_stall()  # a save before the last one's copy was waited for (the end of a run)
        if self.writer is None:
            self.failures.retry_due = False  # this save is the retry
            result = write_full_checkpoint(
                trainer, model, trial, resume, self.processes, self.model_sharded, self.lock
            )
            self._settled(result, final)
        else:
            self._settled(self.writer.settle(wait=True))  # at most one save in flight
            self.failures.retry_due = False  # this save is the retry
            self._start_sharded(trainer, model, trial, resume, final)
            if not self.writer.asynchronous:
                self._settled(self.writer.settle(wait=True), final)
        self._held = time.perf_counter() - started
        if self.writer is None or not self.writer.asynchronous:
            self._record_stall()

    def before_optimizer_step(self) -> None:
        """Before the optimizer changes the weights and moments (every rank): the copy of a save in
        flight is taken by then; what the step waited counts in `perf/checkpoint_stall_s`."""
        if self._held is not None:
            self._record_stall()

    def _record_stall(self) -> None:
        if self._held is None:
            return
        waited = self.writer.wait_for_copy() if self.writer is not None else 0.0
        self.window.record("perf/checkpoint_stall_s", self._held + waited)
        self._held = None

    def check(self, control) -> None:
        """At a step's end: a save in flight that every rank has finished is settled (a collective
        while one is in flight); after a failed save, `control` asks for a save at once (the retry)."""
        if self.writer is not None and self.writer.in_flight:
            self._settled(self.writer.settle(wait=False))
        if self.failures.retry_due:
            control.should_save = True

    def wait(self, final: bool = False) -> None:
        """Until the save in flight is settled: durable, or failed and reported (every rank; `final`:
        a failure raises, there is no later step to retry at)."""
        self._record_stall()
        if self.writer is not None:
            self._settled(self.writer.settle(wait=True), final)

    def finish(self, trainer: Trainer, model, trial, resume_point: Callable[[], ResumePoint]) -> None:
        """Training ended: wait for the save in flight; a last save that failed is tried once more,
        with the state `resume_point()` gives, and a second failure raised."""
        self.wait()
        if self.failures.retry_due:
            self.save(trainer, model, trial, resume_point(), final=True)
            self.wait(final=True)

    def close(self) -> None:
        """The run ends, also after a failure: a save in flight is finished by this process's writer
        (its part of the files lands; rank 0 renames the checkpoint into place when every rank's did),
        without a collective, and the staging memory is given back."""
        if self.writer is not None:
            if self.writer.in_flight:
                logger.info("waiting for the checkpoint being written to reach the disk")
            self.writer.close()

    def _settled(self, result: SaveResult | None, final: bool = False) -> None:
        if result is None:
            return
        staging = self._staging.pop(result.step, None)
        if result.error is None:
            self.failures.succeeded()
            self.window.record("perf/checkpoint_write_s", result.seconds)
            return
        if staging is not None and self.processes.is_main:
            shutil.rmtree(staging, ignore_errors=True)  # its space given back; the older ones stay
        self.window.record("train/checkpoint_failures_count", 1, Reduce.SUM)
        self.failures.failed(result, final)

    def _start_sharded(self, trainer: Trainer, model, trial, resume: ResumePoint, final: bool) -> None:
        """Rank 0 writes the small files; every rank its RNG; then every rank's shards (in the
        background when asynchronous)."""
        step = trainer.state.global_step
        run_directory = Path(trainer._get_output_dir(trial=trial))
        destination = run_directory / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        staging = staging_path(destination)
        note_best_checkpoint(trainer, run_directory)
        refuse_if_taken_over(self.lock, run_directory, self.processes)
        unwrapped = trainer.accelerator.unwrap_model(model)
        failure = None
        if self.processes.is_main:
            shutil.rmtree(staging, ignore_errors=True)
            failure = _attempt(lambda: _prepare(trainer, unwrapped, staging, resume))
        described = self.processes.broadcast(_describe(failure, self.processes.rank))
        if described is None:  # the directory is there: every rank adds its RNG
            failure = _attempt(lambda: _save_rng(trainer, staging))
            described = next(
                (text for text in self.processes.gather(_describe(failure, self.processes.rank)) if text),
                None,
            )
        self._staging[step] = staging
        if described is not None:
            self._settled(SaveResult(step, 0.0, described, failure), final)
            return
        optimizer = None if trainer.args.save_only_model else torch_optimizer(trainer.optimizer)
        if optimizer is not None and not optimizer.state:
            optimizer = None  # no step taken yet: nothing to save (reading it would make a state up)
        peft_adapter = unwrapped.active_adapter if hasattr(unwrapped, "peft_config") else None
        state = training_state(unwrapped, optimizer, trainable_only=peft_adapter is not None)
        manifest = ShardedManifest(
            step=step,
            world_size=self.processes.world_size,
            holds_optimizer=optimizer is not None,
            dtype=str(next(p for p in unwrapped.parameters() if p.requires_grad).dtype).removeprefix(
                "torch."
            ),
            peft_adapter=peft_adapter,
            aliases=tied_aliases(unwrapped),
        )
        publish = None
        if self.processes.is_main:
            push = trainer._push_from_checkpoint if trainer.args.push_to_hub else None
            publish = partial(
                publish_sharded,
                staging,
                destination,
                manifest,
                self.lock,
                trainer.args.save_total_limit,
                trainer.state.best_model_checkpoint,
                push,
            )
        self.writer.start(step, state, staging / SHARDS_DIR, publish)


def publish_sharded(
    staging: Path,
    destination: Path,
    manifest: ShardedManifest,
    lock: OwnerLock | None,
    save_total_limit: int | None,
    best_checkpoint: str | None,
    push: Callable[[str], None] | None,
) -> None:
    """Rank 0, once every rank's shards are on the disk: the manifest (the last file), the staging
    directory made durable and renamed into place, then older checkpoints rotated away."""
    if lock is not None and not lock.held():
        raise DirectoryInUseError(
            f"{lock.path.parent}: another run took this directory over; no checkpoint is published"
        )
    manifest.save(staging)
    publish_directory(staging, destination)
    rotate_checkpoints(
        output_dir=str(destination.parent),
        save_total_limit=save_total_limit,
        best_model_checkpoint=best_checkpoint,
    )
    if push is not None:
        push(str(destination))


def _prepare(trainer: Trainer, model, staging: Path, resume: ResumePoint) -> None:
    staging.mkdir(parents=True)
    write_sharded_run_files(trainer, model, staging, resume)


def _save_rng(trainer: Trainer, staging: Path) -> None:
    """This rank's RNG state (as the base Trainer names it), flushed by the rank that wrote it."""
    trainer._save_rng_state(str(staging))
    for path in staging.glob("rng_state*.pth"):
        fsync_path(path)


def _attempt(write: Callable[[], None]) -> OSError | None:
    try:
        write()
    except OSError as error:
        return error
    return None


def _describe(error: BaseException | None, rank: int) -> str | None:
    return f"rank {rank}: {type(error).__name__}: {error}" if error is not None else None
