"""The run's timeline: what each process did when, as Chrome trace events (docs/timeline.md).

Every process of a run records complete events ('X': a name, a start and a duration in
microseconds) on named lanes through one call, `span(name)` (or `interval` for an interval measured
elsewhere); where no recorder is active the call does nothing. The trainer keeps its own events and
the rollout worker's (which it drains from the worker's queue) per optimizer step, keeps a bounded
choice of steps, and writes them as `timeline.json`, which Perfetto and chrome://tracing open.

One clock for every process: the wall clock (`time.time_ns`). Python promises nothing about the
origin of `perf_counter` or `monotonic` across processes, while every process of one host reads the
same wall clock; a run's timeline spans seconds to days, where the wall clock's rare adjustments
matter less than a shared origin.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

logger = logging.getLogger(__name__)

# Steps kept whole: the first ones (start-up: spawning the worker, first requests, compilation, the
# first syncs), a fixed number spread over the middle of the run (every Kth step, K doubling whenever
# they would be more: a run of any length is sampled evenly), and the last ones (where the run ended,
# or crashed). Whatever the run's length, the file holds at most 1 + 10 + 64 + 10 steps.
FIRST_STEPS_KEPT = 10
EVERY_KTH_STEP_KEPT = 50  # K at the start
SAMPLED_STEPS_KEPT = 64
LAST_STEPS_KEPT = 10
# Events kept per step, whatever the step holds. A step records a few events per micro-batch and one
# per rollout and per scored group, so this covers hundreds of rollouts a step. Events beyond it
# are counted, not kept.
MAX_EVENTS_PER_STEP = 1000
# The file's hard bound: steps that would take it past this many bytes are left out whole (the
# middle's sampled steps first) and counted (`otherData.steps_over_size_cap`).
MAX_FILE_BYTES = 32 * 2**20
# The trainer rewrites the file at most this often (and at the end), in a thread of its own, so a run
# that crashes still has a timeline of all but its last seconds and the training loop never waits for
# the write.
WRITE_INTERVAL_S = 30.0
# Counter samples (CPU use: asyncgrpo/run/cpu_use.py) kept per step, apart from the events so that they
# never crowd out a step's phases: at four ticks a second and seven samples a tick (three processes,
# a server of two), a step's first 35 s. A step's counters past them are counted, not kept.
MAX_COUNTERS_PER_STEP = 1000
# The worker sends its events with each metrics flush; at most this many wait between two flushes.
MAX_PENDING_EVENTS = MAX_EVENTS_PER_STEP

TRAINER = "trainer"
WORKER = "rollout worker"
SERVERS = "vLLM servers"
# Process lanes in the file are numbered in the order trainer, rollout worker(s), servers (Chrome
# trace `pid`s are numbers: `process_ids` keeps them stable).
MAIN_LANE = "main"
STEP_FRAME = "step"  # the trainer's span around each optimizer step
# Before the first optimizer step: start-up, kept whole.
SETUP_STEP = 0


def now_us() -> int:
    """The shared clock, in microseconds (see the module's docstring)."""
    return time.time_ns() // 1000


def worker_process(index: int, count: int) -> str:
    """The process lane of rollout worker `index` of `count`: one worker keeps the plain name."""
    return WORKER if count == 1 else f"{WORKER} {index}"


def process_ids(seen: set[str]) -> dict[str, int]:
    """Chrome trace `pid`s of the processes in `seen`: the trainer, the rollout workers by index, the
    servers (the fixed ones always, so a file without worker events still names every process)."""
    workers = sorted((name for name in seen if name.startswith(WORKER)), key=lambda name: (len(name), name))
    ordered = [TRAINER, *(workers or [WORKER]), SERVERS]
    return {name: index + 1 for index, name in enumerate(ordered)}


def event(name: str, start_us: int, end_us: int, process: str, lane: str, **args) -> dict:
    """One complete event, before the file's numbering of processes and lanes."""
    return {
        "name": name,
        "ts": int(start_us),
        "dur": max(0, int(end_us) - int(start_us)),
        "process": process,
        "lane": lane,
        "args": args,
    }


class EventSink:
    """Where a process's events go; the trainer keeps them (`TimelineRecorder`), the worker sends
    them on (`EventBuffer`)."""

    process = TRAINER

    def add(self, item: dict) -> None:
        raise NotImplementedError


_sink: EventSink | None = None  # this process's recorder; None: recording is off
_sink_lock = threading.Lock()  # reward threads and the worker's event loop record side by side


def activate(sink: EventSink | None) -> None:
    """Make `sink` this process's recorder (None: stop recording)."""
    global _sink
    _sink = sink


def active() -> EventSink | None:
    """This process's recorder, or None."""
    return _sink


def interval(
    name: str, start_us: int, end_us: int, lane: str = MAIN_LANE, process: str | None = None, **args
):
    """An interval measured by the caller, on `lane` of this process (or of `process`, for the
    servers' pauses, which the trainer observes)."""
    sink = _sink
    if sink is None:
        return
    item = event(name, start_us, end_us, process or sink.process, lane, **args)
    with _sink_lock:
        sink.add(item)


@contextmanager
def span(name: str, lane: str = MAIN_LANE, **args) -> Iterator[None]:
    """Record the block as one event. Spans opened inside it on the same lane nest under it."""
    if _sink is None:
        yield
        return
    started = now_us()
    try:
        yield
    finally:
        interval(name, started, now_us(), lane, **args)


class EventBuffer(EventSink):
    """The rollout worker's recorder: events wait here until the next metrics flush sends them."""

    def __init__(self, limit: int = MAX_PENDING_EVENTS, process: str = WORKER):
        self.process = process
        self.limit = limit
        self.pending: list[dict] = []
        self.dropped = 0

    def add(self, item: dict) -> None:
        if len(self.pending) < self.limit:
            self.pending.append(item)
        else:
            self.dropped += 1

    def take(self) -> tuple[list[dict], int]:
        """The pending events and how many were dropped since the last take; starts over."""
        with _sink_lock:
            taken, dropped = self.pending, self.dropped
            self.pending, self.dropped = [], 0
        return taken, dropped


class Lanes:
    """Lanes for concurrent intervals (requests in flight): each takes the lowest free lane, so
    the timeline shows as many lanes as intervals ever overlapped."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._free: list[int] = []
        self._next = 0

    def take(self) -> str:
        if self._free:
            self._free.sort()
            index = self._free.pop(0)
        else:
            index, self._next = self._next, self._next + 1
        return f"{self.prefix} {index}"

    def give_back(self, lane: str) -> None:
        self._free.append(int(lane.rsplit(" ", 1)[1]))


class StepSelection:
    """Which finished steps' events are kept: the first `first`, at most `sampled` of the others
    spread over the run (every `every`-th; when they would be more, `every` doubles and the steps
    off the new stride go), and the newest `last - 1` of the rest (a ring buffer), so that with the
    step still running the last `last` steps are always there. Step 0 (start-up) is always kept."""

    def __init__(self, first: int, every: int, last: int, sampled: int = SAMPLED_STEPS_KEPT):
        self.first, self.every, self.sampled_limit = first, every, sampled
        self.kept: dict[int, list[dict]] = {}  # start-up and the first steps
        self.sampled: dict[int, list[dict]] = {}
        self.recent: deque[tuple[int, list[dict]]] = deque(maxlen=max(0, last - 1))

    def close(self, step: int, events: list[dict]) -> None:
        if step <= self.first:
            self.kept[step] = events
        elif self.every > 0 and self.sampled_limit > 0 and step % self.every == 0:
            self.sampled[step] = events
            while len(self.sampled) > self.sampled_limit:
                self.every *= 2
                self.sampled = {kept: e for kept, e in self.sampled.items() if kept % self.every == 0}
        else:
            self.recent.append((step, events))

    def steps(self) -> list[tuple[int, list[dict]]]:
        """Every kept step, the first and the newest before the sampled middle (the order the file
        keeps them in when it must leave steps out)."""
        return [*sorted(self.kept.items()), *self.recent, *sorted(self.sampled.items(), reverse=True)]


class TimelineRecorder(EventSink):
    """The trainer's recorder: events of the current step, a bounded choice of finished steps, and
    the file. Events arriving during step N (the worker's included) belong to step N."""

    process = TRAINER

    def __init__(
        self,
        path: str | os.PathLike,
        first_steps: int = FIRST_STEPS_KEPT,
        every_kth_step: int = EVERY_KTH_STEP_KEPT,
        last_steps: int = LAST_STEPS_KEPT,
        max_events_per_step: int = MAX_EVENTS_PER_STEP,
        max_counters_per_step: int = MAX_COUNTERS_PER_STEP,
        write_interval_s: float = WRITE_INTERVAL_S,
        sampled_steps: int = SAMPLED_STEPS_KEPT,
        max_file_bytes: int = MAX_FILE_BYTES,
    ):
        self.path = Path(path)
        self.selection = StepSelection(first_steps, every_kth_step, last_steps, sampled_steps)
        self.max_file_bytes = max_file_bytes
        self._writer: threading.Thread | None = None
        self.max_events_per_step = max_events_per_step
        self.max_counters_per_step = max_counters_per_step
        self.write_interval_s = write_interval_s
        self.step = SETUP_STEP
        self.current: list[dict] = []
        self.dropped = 0  # events beyond max_events_per_step, over the run
        self.events = 0  # events of the current step (counters apart)
        self.counters = 0  # counter samples of the current step
        self.counters_dropped = 0  # beyond max_counters_per_step, over the run
        self.cores = os.cpu_count()  # what the CPU counters' "cores busy" is out of
        self._last_write = time.monotonic()

    def add(self, item: dict) -> None:
        item["args"]["step"] = self.step
        # The step's own frame ends last, after everything it holds: kept past the cap, or a step
        # that filled it (a long start-up's rollouts) would lose the event that marks it.
        frame = item["name"] == STEP_FRAME and item["process"] == TRAINER and item["lane"] == MAIN_LANE
        if self.events < self.max_events_per_step or frame:
            self.current.append(item)
            self.events += 1
        else:
            self.dropped += 1

    def add_counter(self, item: dict) -> None:
        """A counter sample ('C'); its args are its series, so the step is not added to them."""
        with _sink_lock:
            if self.counters < self.max_counters_per_step:
                self.current.append(item)
                self.counters += 1
            else:
                self.counters_dropped += 1

    def add_worker_events(self, events: list[dict], dropped: int) -> None:
        with _sink_lock:
            for item in events:
                self.add(item)
            self.dropped += dropped

    def begin_step(self, step: int) -> None:
        """Close the current step's events into the selection; what follows belongs to `step`."""
        with _sink_lock:
            self.selection.close(self.step, self.current)
            self.step, self.current, self.events, self.counters = step, [], 0, 0

    def trace(self) -> dict:
        """The Chrome trace as the file holds it (see `write`)."""
        return json.loads("".join(self._render()))

    def _render(self) -> Iterator[str]:
        """The file's text, piece by piece: metadata naming processes and lanes, then the kept steps'
        events, each step whole or left out at MAX_FILE_BYTES. One event per piece: a write from
        another thread lets the training thread run between pieces."""
        with _sink_lock:
            steps = [*self.selection.steps(), (self.step, list(self.current))]
            dropped, counters_dropped = self.dropped, self.counters_dropped
        pids = process_ids({item["process"] for _, step_events in steps for item in step_events})
        lanes: dict[tuple[str, str], int] = {}
        for _, step_events in steps:
            for item in step_events:
                if item.get("ph") != "C":
                    lanes.setdefault((item["process"], item["lane"]), len(lanes) + 1)
        metadata = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}
            for name, pid in pids.items()
        ] + [
            {"name": "thread_name", "ph": "M", "pid": pids[process], "tid": tid, "args": {"name": lane}}
            for (process, lane), tid in lanes.items()
        ]
        pieces = [json.dumps(item) for item in metadata]
        yield '{"traceEvents": [' + ", ".join(pieces)
        written, kept, left_out = sum(map(len, pieces)), [], 0
        separator = ", " if pieces else ""
        for step, step_events in steps:
            encoded = [json.dumps(_chrome_event(item, pids, lanes)) for item in step_events]
            size = sum(len(piece) + 2 for piece in encoded)
            if written + size > self.max_file_bytes:
                left_out += 1
                continue
            written += size
            kept.append(step)
            for piece in encoded:
                yield separator + piece
                separator = ", "
        other = {
            "steps_kept": sorted(kept),
            "events_dropped": dropped,
            "counters_dropped": counters_dropped,
            "steps_over_size_cap": left_out,
            "cpu_cores": self.cores,
            "clock": "wall clock, microseconds since the Unix epoch",
        }
        yield f'], "displayTimeUnit": "ms", "otherData": {json.dumps(other)}}}'

    def write(self) -> None:
        """The whole file, atomically: a reader never sees half of it. Waits for a write in flight."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        self._write()

    def _write(self) -> None:
        staging = self.path.with_name(f".{self.path.name}.partial")
        with open(staging, "w", encoding="utf-8") as file:
            for piece in self._render():
                file.write(piece)
        os.replace(staging, self.path)

    def _write_in_background(self) -> None:
        try:
            self._write()
        except OSError as error:  # a full disk must not stop training; the next write tries again
            logger.warning("could not write %s: %s", self.path, error)

    def write_if_due(self) -> None:
        """Start a write in a thread of its own when one is due and none is in flight."""
        if time.monotonic() - self._last_write < self.write_interval_s:
            return
        if self._writer is not None and self._writer.is_alive():
            return
        self._last_write = time.monotonic()
        self._writer = threading.Thread(target=self._write_in_background, name="timeline-writer", daemon=True)
        self._writer.start()


def _chrome_event(item: dict, pids: dict[str, int], lanes: dict[tuple[str, str], int]) -> dict:
    """A recorded event with the file's numbering: a counter ('C', a process's, on no lane) or a
    complete event on its lane."""
    if item.get("ph") == "C":
        return {
            "name": item["name"],
            "ph": "C",
            "ts": item["ts"],
            "pid": pids[item["process"]],
            "tid": 0,
            "args": item["args"],
        }
    return {
        "name": item["name"],
        "ph": "X",
        "ts": item["ts"],
        "dur": item["dur"],
        "pid": pids[item["process"]],
        "tid": lanes[(item["process"], item["lane"])],
        "args": item["args"],
    }
