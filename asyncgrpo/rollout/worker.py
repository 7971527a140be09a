"""The rollout process: spawning it, watching it, hearing from it, stopping it.

The loop runs in a spawned process with `CUDA_VISIBLE_DEVICES=""` (reward code must never take the
trainer's GPU). Everything sent to it must pickle, so that is checked before spawning, naming the
object that does not. The trainer never waits blindly: every wait watches the worker's failure
event (its exception and traceback come back verbatim), its exit code and its heartbeat. Neither side
can be left behind by the other: the worker watches the trainer's pid and always leaves with
`os._exit`, and the trainer reads the worker's queues in daemon threads
(docs/reliability.md#the-rollout-process-and-the-trainer says why).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from asyncgrpo.errors import RolloutError
from asyncgrpo.rollout.channels import WorkerChannels
from asyncgrpo.rollout.context import LoopInputs
from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.rollout.prompts import StreamStart
from asyncgrpo.run.files import attach_warnings_file
from asyncgrpo.run.parent_watch import exit_when_parent_dies

logger = logging.getLogger(__name__)


class RolloutWorkerError(RolloutError):
    """The rollout process failed, hung or died; training cannot continue."""


@dataclass(frozen=True)
class WorkerInputs:
    """What each rollout process is started with, beside its channels (all of it pickles)."""

    loop: LoopInputs  # what its rollout loop is built from
    stream: StreamStart = StreamStart()  # where its prompt stream resumes


def worker_inputs(
    config, *, dataset_start_index: int = 0, skip_stream_indices=frozenset(), **loop_fields
) -> WorkerInputs:
    """The rollout processes' inputs, from the trainer's config (its settings are built here, in the
    trainer's process), where the prompt stream resumes, and LoopInputs' other fields."""
    return WorkerInputs(
        LoopInputs.of(config, **loop_fields), StreamStart(dataset_start_index, frozenset(skip_stream_indices))
    )


def check_picklable(objects: dict[str, Any]) -> None:
    """Raise a TypeError naming the first object that cannot be sent to the rollout process."""
    for description, value in objects.items():
        try:
            pickle.dumps(value)
        except Exception as error:
            raise TypeError(
                f"{description} cannot be sent to the rollout worker process ({type(error).__name__}: "
                f"{error}). Everything the worker runs must pickle: use a module-level function, "
                "functools.partial or an instance of a module-level callable class; lambdas and closures do "
                "not pickle."
            ) from error


def check_worker_payload(reward_funcs, loop_cls, tools=None, environment_factory=None) -> None:
    """Everything the worker process will run, checked one by one so the error names the culprit."""
    check_picklable({"loop_cls": loop_cls})
    for index, function in enumerate(reward_funcs or []):
        check_picklable({f"reward function #{index} ({getattr(function, '__name__', function)!r})": function})
    for index, tool in enumerate(tools or []):
        check_picklable({f"tool #{index} ({getattr(tool, '__name__', tool)!r})": tool})
    check_picklable({"environment_factory": environment_factory})


def _worker_main(loop_cls, inputs: WorkerInputs, channels: WorkerChannels) -> None:
    """Entry point of the spawned process: its scheduler builds the loop and runs it."""
    exit_when_parent_dies(channels.parent_pid)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # The trainer stops us with SIGTERM; Ctrl-C reaches the whole process group, and the trainer
    # decides what happens then, so SIGINT is ignored here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Sync reward functions and tools run in threads while the event loop thread is nearly always
    # busy: at Python's default GIL switch interval a trivial reward waited far longer for its turn than
    # it ran (bench/RESULTS.md, "worker_throughput").
    sys.setswitchinterval(0.0005)
    attach_warnings_file()  # the run directory's warnings.log, when the trainer keeps one
    exit_code = 0
    try:
        # Imported here, in the rollout process: the scheduler's HTTP client needs msgspec, which the
        # trainer's side of a GPU host may lack.
        from asyncgrpo.rollout.scheduler import RolloutScheduler

        RolloutScheduler(loop_cls, inputs.loop, channels, inputs.stream).run()
    except BaseException as error:  # everything, so the trainer hears of it
        if not isinstance(
            error, (SystemExit, KeyboardInterrupt, asyncio.CancelledError)
        ):  # not a requested stop
            exit_code = 1
            channels.report_failure(error)
    finally:
        channels.close_worker_side()
        sandbox_runner = sys.modules.get("asyncgrpo.sandbox.runner")
        if sandbox_runner is not None:  # a reward or tool may be inside run(): its finally never runs
            sandbox_runner.end_every_run()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)  # threads stuck in user code (a reward, a tool) must not keep us alive


class _QueueReader:
    """Moves a multiprocessing queue's messages into a local queue from a daemon thread, so that
    no trainer thread that matters ever blocks inside a half-written message."""

    def __init__(self, source, name: str, local: queue.Queue | None = None):
        self.source = source
        self.local: queue.Queue = local if local is not None else queue.Queue()  # may be shared
        self._thread = threading.Thread(target=self._pump, name=name, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        while True:
            try:
                message = self.source.get()
            except (EOFError, OSError, ValueError):  # the queue was closed: nothing more will come
                return
            self.local.put(message)

    def get(self, timeout: float):
        """The next message; queue.Empty after `timeout` seconds (0: do not wait)."""
        if timeout <= 0:
            return self.local.get_nowait()
        return self.local.get(timeout=timeout)

    def qsize(self) -> int:
        return self.local.qsize()


def _next_result(results, check_alive, timeout: float) -> GroupResult | None:
    """The next message of `results` within `timeout` seconds, else None; the sending processes are
    checked every half second meanwhile, so a dead worker is an error, never a silent wait."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return results.get(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
        except queue.Empty:
            check_alive()
            if time.monotonic() >= deadline:
                return None


def _drain(reader: _QueueReader) -> list:
    drained = []
    while True:
        try:
            drained.append(reader.get(timeout=0))
        except queue.Empty:
            return drained


@contextmanager
def _child_environment(**variables: str):
    """Spawned children inherit os.environ at start(): set what the child needs around it."""
    saved = {key: os.environ.get(key) for key in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class RolloutWorker:
    """Trainer-side handle of one rollout process (RolloutWorkerPool runs several)."""

    def __init__(
        self,
        loop_cls,
        inputs: WorkerInputs,
        initial_allowance: float,
        worker_timeout: float,
        worker_index: int = 0,
        num_workers: int = 1,
        committed_tokens: Any = None,
        results: queue.Queue | None = None,
        server_urls: list[str] | None = None,
    ):
        self.loop_cls = loop_cls
        self.worker_timeout = worker_timeout
        self._context = multiprocessing.get_context("spawn")
        self.inputs = inputs
        self.channels = WorkerChannels.create(
            self._context, initial_allowance, worker_index, num_workers, committed_tokens, server_urls
        )
        self.name = "asyncgrpo-rollout" if num_workers == 1 else f"asyncgrpo-rollout-{worker_index}"
        self.process: multiprocessing.Process | None = None
        self._results = _QueueReader(self.channels.rollout_buffer, f"{self.name}-results", results)
        self._metrics = _QueueReader(self.channels.metrics_queue, f"{self.name}-metrics")
        self._timeline = _QueueReader(self.channels.timeline_queue, f"{self.name}-timeline")
        self._errors = _QueueReader(self.channels.exception_info_queue, f"{self.name}-errors")

    def start(self, ready_timeout: float) -> None:
        """Spawn the process, wait until it has reached the server and run `setup()`, and let it
        generate."""
        self.spawn()
        self.start_generating(time.monotonic() + ready_timeout, ready_timeout)

    def spawn(self) -> None:
        """Start the process; it starts up (imports, the servers, `setup()`) and then waits for
        `start_generating`, so its start-up can overlap the trainer's (the first weight sync)."""
        loop = self.inputs.loop
        check_worker_payload(loop.reward_funcs, self.loop_cls, loop.tools, loop.environment_factory)
        self.process = self._context.Process(
            target=_worker_main,
            args=(self.loop_cls, self.inputs, self.channels),
            name=self.name,
            # Not a daemon: reward code may start processes of its own (accuracy_reward's verifier
            # pool), which daemons may not. The trainer stops it in every case, and it exits by
            # itself if the trainer dies.
            daemon=False,
        )
        with _child_environment(CUDA_VISIBLE_DEVICES=""):
            self.process.start()

    def start_generating(self, deadline: float, ready_timeout: float) -> None:
        """Wait until the spawned worker is ready (until `deadline`, `ready_timeout` seconds after the
        wait began), then let it generate."""
        while not self.channels.ready_event.wait(0.2):
            self.check_alive()
            if time.monotonic() > deadline:
                self.stop()
                raise RolloutWorkerError(f"the rollout worker was not ready after {ready_timeout:.0f} s")
        self.channels.heartbeat_value.value = time.time()
        self.channels.start_event.set()

    def check_alive(self) -> None:
        """Raise if the worker failed, exited or stopped beating."""
        if self.channels.failed_event.is_set():
            try:
                name, message, trace = self._errors.get(timeout=5)
            except queue.Empty:
                name, message, trace = "UnknownError", "(no details)", ""
            self.process.join(5)  # it leaves by itself after a failure; stop() only if it does not
            self.stop()
            raise RolloutWorkerError(
                f"the rollout worker failed with {name}: {message}\n\nWorker traceback:\n{trace}"
            )
        if self.process is None or not self.process.is_alive():
            code = None if self.process is None else self.process.exitcode
            raise RolloutWorkerError(f"the rollout worker process exited unexpectedly (exit code {code})")
        beat = self.channels.heartbeat_value.value
        if beat and time.time() - beat > self.worker_timeout:
            self.stop()
            raise RolloutWorkerError(
                f"no heartbeat from the rollout worker for {time.time() - beat:.0f} s "
                f"(rollout_worker_timeout={self.worker_timeout:.0f}): it is hung, and was stopped"
            )

    def next_result(self, timeout: float) -> GroupResult | None:
        """The next group result, or None if none arrived within `timeout` seconds."""
        return _next_result(self._results, self.check_alive, timeout)

    def publish_allowance(self, cumulative_tokens: float) -> None:
        self.channels.token_allowance.value = float(cumulative_tokens)

    def publish_model_version(self, version: int) -> None:
        self.channels.model_version_value.value = int(version)

    def publish_servers(self, urls: list[str], admissions: dict[str, int]) -> None:
        """The run's live servers changed: the worker takes its share of `urls`."""
        self.channels.servers_queue.put((list(urls), dict(admissions)))

    def drain_metrics(self) -> list[dict]:
        return _drain(self._metrics)

    def drain_timeline(self) -> list[tuple[list[dict], int]]:
        """The worker's timeline events sent since the last call: (events, events it dropped)."""
        return _drain(self._timeline)

    def requests_running(self) -> int:
        return int(self.channels.requests_running.value)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`; never leaves the process behind."""
        process = self.process
        if process is None:
            return
        if process.is_alive():
            process.terminate()
            process.join(timeout)
            if process.is_alive():
                process.kill()
                process.join(5)
        self.channels.close_trainer_side()


class RolloutWorkerPool:
    """Trainer-side handle of the run's rollout processes (`num_rollout_workers`): one result stream,
    one staleness budget, and any worker's failure is the pool's. How the work is shared:
    rollout/worker_shares.py."""

    def __init__(
        self,
        loop_cls,
        inputs: WorkerInputs,
        num_workers: int,
        initial_allowance: float,
        worker_timeout: float,
        server_urls: list[str] | None = None,
    ):
        context = multiprocessing.get_context("spawn")
        committed_tokens = context.Array("d", num_workers, lock=False)
        self._results: queue.Queue = queue.Queue()
        self.workers = [
            RolloutWorker(
                loop_cls,
                inputs,
                initial_allowance,
                worker_timeout,
                worker_index=index,
                num_workers=num_workers,
                committed_tokens=committed_tokens,
                results=self._results,
                server_urls=server_urls,
            )
            for index in range(num_workers)
        ]

    @property
    def processes(self) -> list[multiprocessing.Process | None]:
        return [worker.process for worker in self.workers]

    def start(self, ready_timeout: float) -> None:
        """Spawn every process, then wait until all have reached their servers and run `setup()`
        (they start side by side), and let them generate."""
        self.spawn()
        self.start_generating(ready_timeout)

    def spawn(self) -> None:
        """Start every process; they start up side by side and wait for `start_generating`."""
        try:
            for worker in self.workers:
                worker.spawn()
        except BaseException:
            self.stop()
            raise

    def start_generating(self, ready_timeout: float) -> None:
        """Wait until every worker is ready (at most `ready_timeout` seconds in all), then let them
        generate."""
        deadline = time.monotonic() + ready_timeout
        try:
            for worker in self.workers:
                worker.start_generating(deadline, ready_timeout)
        except BaseException:
            self.stop()
            raise

    def check_alive(self) -> None:
        try:
            for worker in self.workers:
                worker.check_alive()
        except RolloutWorkerError:
            self.stop()  # the others cannot go on alone: their shares of the prompts would never come
            raise

    def next_result(self, timeout: float) -> GroupResult | None:
        """The next group result from any worker, or None if none arrived within `timeout` seconds."""
        return _next_result(self._results, self.check_alive, timeout)

    def publish_allowance(self, cumulative_tokens: float) -> None:
        for worker in self.workers:
            worker.publish_allowance(cumulative_tokens)

    def publish_model_version(self, version: int) -> None:
        for worker in self.workers:
            worker.publish_model_version(version)

    def publish_servers(self, urls: list[str], admissions: dict[str, int]) -> None:
        for worker in self.workers:
            worker.publish_servers(urls, admissions)

    def drain_metrics(self) -> list[dict]:
        return [window for worker in self.workers for window in worker.drain_metrics()]

    def drain_timeline(self) -> list[tuple[list[dict], int]]:
        return [batch for worker in self.workers for batch in worker.drain_timeline()]

    def requests_running(self) -> int:
        return sum(worker.requests_running() for worker in self.workers)

    def stop(self, timeout: float = 10.0) -> None:
        """One SIGTERM to every process at once, then SIGKILL to those still there after `timeout`;
        none is left behind. (A second SIGTERM would interrupt a worker's clean-up: its close() hook
        ends the agents and sessions it started.)"""
        running = [w.process for w in self.workers if w.process is not None and w.process.is_alive()]
        for process in running:
            process.terminate()
        deadline = time.monotonic() + timeout
        for process in running:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in running:
            if process.is_alive():
                process.kill()
                process.join(5)
        for worker in self.workers:
            worker.channels.close_trainer_side()
