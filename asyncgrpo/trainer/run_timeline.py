"""Rank 0's timeline of one run: its own phases, the rollout workers' and the servers' pauses, and the
CPU counters of its processes (asyncgrpo/run/cpu_use.py). Written once the run ends, also after a failure,
so the file shows where the run stopped (docs/timeline.md)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

from asyncgrpo.rollout.worker import RolloutWorkerPool
from asyncgrpo.run import timeline
from asyncgrpo.run.cpu_use import CpuSampler, Tracked
from asyncgrpo.run.files import TIMELINE_FILE

logger = logging.getLogger(__name__)


class RunTimeline:
    """The recorder (the active one while the run goes on) and the sampler of its CPU counters.
    `servers`: the vLLM servers whose CPU use it shows; `worker`: the run's rollout workers, once
    there are some."""

    def __init__(self, output_dir: str, servers: list[str], worker: Callable[[], RolloutWorkerPool | None]):
        self.recorder = timeline.TimelineRecorder(Path(output_dir) / TIMELINE_FILE)
        self.worker = worker
        timeline.activate(self.recorder)
        self.cpu_sampler = CpuSampler(self.recorder.add_counter, self._own_processes, servers)
        self.cpu_sampler.start()

    def _own_processes(self) -> list[Tracked]:
        """The run's processes whose CPU use the timeline shows: this one and the rollout workers."""
        found = [(timeline.TRAINER, timeline.TRAINER, os.getpid())]
        pool = self.worker()
        processes = pool.processes if pool is not None else []
        for index, process in enumerate(processes):
            if process is not None and process.pid is not None:
                name = timeline.worker_process(index, len(processes))
                found.append((name, name, process.pid))
        return found

    def close(self) -> None:
        """The sampler stopped and the timeline's last write."""
        self.cpu_sampler.stop()
        timeline.activate(None)
        try:
            self.recorder.write()
        except OSError as error:  # a full disk must not hide the run's own error
            logger.warning("could not write %s: %s", self.recorder.path, error)
