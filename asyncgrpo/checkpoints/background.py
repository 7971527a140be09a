"""Writing a sharded checkpoint while training goes on (docs/reliability.md, "Durable checkpoints").

A save must capture the state of its step, and only the optimizer's next step changes it: the
forward and backward of the next step only read the parameters. So `ShardedWriter.start` returns at
once and a thread of this process copies its shards out of the live tensors (on a GPU: out of device
memory, on a stream of its own, into host memory kept for the run's saves), then writes the copy with
torch.distributed.checkpoint, every file flushed to the disk, then runs rank 0's `publish` (the rename
that makes the checkpoint count). The training loop calls `wait_for_copy` before its next optimizer
step: all it waits for is what is left of the copy. The threads of all processes meet in a gloo group of
their own, never in the training's collectives. At most one save is in flight: the next one first
waits for it.

Whether a save has finished is agreed by all processes (`settle`: one small collective a step while a
save is in flight), so that every process sees the same outcome at the same step: a failure on any
rank is everyone's, and the retry is a collective save like any other (checkpoints/failures.py).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from asyncgrpo.errors import CheckpointError
from asyncgrpo.run import timeline

logger = logging.getLogger(__name__)

WRITER_LANE = "checkpoint writer"
# id of the default process group -> (it, the writers' group); holding it keeps its id its own.
_WRITERS_GROUPS: dict[int, tuple] = {}


class Collectives(Protocol):
    """The training processes as the writer needs them (trainer/distributed.py's `Processes`)."""

    rank: int
    world_size: int

    def gather(self, value): ...


@dataclass
class SaveResult:
    """How a save ended, the same on every process."""

    step: int
    seconds: float  # from the save's start until it was durable (or failed)
    error: str | None  # "rank R: what failed" of the first rank that failed; None: durable
    local_error: BaseException | None = None  # the failed rank's exception (OSError...), to raise


def root_error(error: BaseException, rank: int) -> tuple[int, BaseException]:
    """(the rank that failed, its exception): DCP reports the failures of every rank to every rank
    as one CheckpointException mapping ranks to (exception, traceback)."""
    if isinstance(error, CheckpointException) and error.failures:
        failed_rank, (exception, _) = next(iter(sorted(error.failures.items())))
        return failed_rank, exception
    return rank, error


@dataclass
class _Pending:
    step: int
    started: float
    future: Future
    thread: threading.Thread | None = None  # the asynchronous save's writer

    def end(self) -> None:
        """Wait for the save's outcome, then for its thread to end: a writer thread still alive when
        the interpreter exits is stopped inside torch's C++ code, which aborts the process ("terminate
        called without an active exception") after the save has succeeded."""
        _wait_quietly(self.future)
        if self.thread is not None:
            self.thread.join()


class ShardedWriter:
    """Writes the shards of sharded checkpoints for one run, in the background (`asynchronous`) or
    inline. Every process makes one and calls each method at the same point."""

    def __init__(self, collectives: Collectives, asynchronous: bool):
        self.collectives = collectives
        self.asynchronous = asynchronous
        self._stager: DefaultStager | None = None  # the staging copy's memory, kept between saves
        self._copied: threading.Event | None = None  # set once the save in flight has its copy
        self._pending: _Pending | None = None

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def start(self, step: int, state: dict, shards: Path, publish: Callable[[], None] | None) -> float:
        """Begin writing `state` (checkpoints/sharded_state.py's `training_state`: views of the live
        tensors) into `shards`; `publish` runs on rank 0 once every rank's shards are on the disk (None
        on the others). Asynchronous: returns at once, and `wait_for_copy` must come before anything
        changes the live tensors. Returns the seconds the caller was held (the whole save when
        synchronous). A save still in flight must have been settled first."""
        if self._pending is not None:
            raise RuntimeError("a checkpoint is still being written: settle(wait=True) first")
        started = time.perf_counter()
        group = self._writers_group()
        future: Future = Future()
        worker = None
        if self.asynchronous:
            self._copied = threading.Event()
            # On a GPU the copy waits for the work queued so far (the step's optimizer update) on a
            # stream of its own, beside the next step's forward and backward.
            ready = None
            if torch.cuda.is_available():
                ready = (torch.cuda.current_device(), torch.cuda.Event())
                ready[1].record()
            worker = threading.Thread(
                target=self._copy_then_write,
                args=(state, ready, shards, group, publish, future, self._copied),
                name="checkpoint-writer",
                daemon=True,  # an abandoned save leaves a staging directory, which the next start clears
            )
            worker.start()
        else:
            self._write(state, shards, group, publish, future)
        self._pending = _Pending(step, started, future, worker)
        return time.perf_counter() - started

    def wait_for_copy(self) -> float:
        """Before the live tensors change (the optimizer's step, every process): until this process's
        copy of its shards is taken. Returns the seconds waited (0 when it was done, or none is taken)."""
        if self._copied is None:
            return 0.0
        started = time.perf_counter()
        self._copied.wait()
        self._copied = None
        return time.perf_counter() - started

    def _copy_then_write(self, state, ready, shards: Path, group, publish, future: Future, copied) -> None:
        began = timeline.now_us()
        try:
            staged = self._copy_out(state, ready)
        except BaseException as error:  # out of host memory: a failed save like any other
            future.set_exception(_RankFailure(self.collectives.rank, error))
            return
        finally:
            del state  # the views of the live tensors
            copied.set()
            if self.collectives.rank == 0:
                timeline.interval("copy shards out", began, timeline.now_us(), lane=WRITER_LANE)
        self._write(staged, shards, group, publish, future)

    def _copy_out(self, state: dict, ready) -> dict:
        """This process's shards copied into the staging memory: host memory allocated at the first
        save and reused by the next ones (pinned on a CUDA machine). A fresh allocation is slow to
        touch (a page fault every 4 KiB); the copy into reused memory runs at memory bandwidth."""
        if self._stager is None:
            self._stager = DefaultStager(StagingOptions(ready is not None, False, False, False))
        if ready is None:
            return self._stager.stage(state)
        device, event = ready
        torch.cuda.set_device(device)  # this thread's device: the training process's own
        stream = torch.cuda.Stream()
        stream.wait_event(event)
        with torch.cuda.stream(stream):
            staged = self._stager.stage(state)
        stream.synchronize()
        return staged

    def close(self) -> None:
        """The staging memory given back (the run ends); a save in flight is waited for first."""
        self.wait_locally()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _writers_group(self):
        """The writers' gloo group: made once per process group (a collective: every process makes
        it at the same first save), kept for the next runs in this process. gloo also where training
        runs on NCCL: the writers' collectives carry a few objects, from threads of their own."""
        if self.collectives.world_size == 1:
            return None
        world = dist.group.WORLD
        known = _WRITERS_GROUPS.get(id(world))
        if known is None or known[0] is not world:
            known = _WRITERS_GROUPS[id(world)] = (world, dist.new_group(backend="gloo"))
        return known[1]

    def _write(self, state: dict, shards: Path, group, publish, future: Future) -> None:
        began = timeline.now_us()
        try:
            writer = dcp.FileSystemWriter(str(shards), sync_files=True)
            dcp.save(state, storage_writer=writer, process_group=group, no_dist=group is None)
            if publish is not None:
                publish()
        except BaseException as error:  # DCP's CheckpointException is a BaseException
            future.set_exception(_RankFailure(*root_error(error, self.collectives.rank)))
        else:
            future.set_result(None)
        finally:
            if self.collectives.rank == 0:
                timeline.interval("write checkpoint", began, timeline.now_us(), lane=WRITER_LANE)

    def wait_locally(self) -> None:
        """Wait for this process's part of the save in flight, without a collective (a failed run:
        the other processes may be gone). Its outcome is not settled."""
        if self._pending is not None:
            self._pending.end()

    def settle(self, wait: bool) -> SaveResult | None:
        """The outcome of the save in flight once every process's part has ended, the same on every
        process; None when none is in flight or (`wait=False`) some process is still writing."""
        pending = self._pending
        if pending is None:
            return None
        if wait:
            pending.end()
        done = pending.future.done()
        failure = pending.future.exception() if done else None
        described = str(failure) if failure is not None else None
        outcomes = (
            self.collectives.gather((done, described))
            if self.collectives.world_size > 1
            else [(done, described)]
        )
        if not all(finished for finished, _ in outcomes):
            return None
        pending.end()  # done: its thread is at its last lines
        self._pending = None
        error = next((text for _, text in outcomes if text is not None), None)
        local = failure.error if failure is not None else None
        return SaveResult(pending.step, time.perf_counter() - pending.started, error, local)


class _RankFailure(CheckpointError):
    def __init__(self, rank: int, error: BaseException):
        super().__init__(f"rank {rank}: {type(error).__name__}: {error}")
        self.error = error


def _wait_quietly(future: Future) -> None:
    try:
        future.result()
    except BaseException:  # read by settle, from the future
        pass
