"""WorkerChannels: everything the trainer and the rollout process share, in one object.

The rollout loop runs in a spawned process; it hears from the trainer (the policy version its servers
run, how many tokens it may generate ahead) and answers it (group results, metric windows, a
heartbeat, the failure that stopped it) through multiprocessing queues, events and shared values.
They are made together by the trainer's RolloutWorker and handed to the loop as one `channels`
argument, so that the loop's constructor holds only what a subclass cares about (the config, the
data, the reward functions, the tools).
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from typing import Any


@dataclass
class WorkerChannels:
    rollout_buffer: Any  # Queue of GroupResult, worker -> trainer
    metrics_queue: Any  # Queue of metric windows (MetricsWindow.stats()), worker -> trainer
    timeline_queue: (
        Any  # Queue of (timeline events, events dropped), worker -> trainer (asyncgrpo/run/timeline.py)
    )
    exception_info_queue: Any  # Queue of (name, message, traceback) of the error that stopped the worker
    # Queue of (live server URLs, {url: admission}), trainer -> worker: the run's servers changed
    # (trainer/server_roster.py); the worker takes its share of them (rollout/worker_shares.py)
    servers_queue: Any
    failed_event: Any  # Event the worker sets once it has put its error on exception_info_queue
    ready_event: Any  # Event the worker sets once it reached the servers and ran setup()
    # Event the trainer sets once the servers run the starting weights: the worker starts up while
    # the trainer syncs them, and generates only after
    start_event: Any
    model_version_value: Any  # Value("q"): the policy version the servers run, trainer -> worker
    token_allowance: Any  # Value("d"): cumulative tokens the worker may have generated (staleness)
    heartbeat_value: Any  # Value("d"): time.time() of the worker's last beat
    requests_running: Any  # Value("q"): the worker's requests in flight, read by the trainer at a sync
    parent_pid: int  # the trainer's pid: the worker exits as soon as it is gone
    # Several workers (num_rollout_workers): which one this is, and the tokens each has committed
    # against the shared staleness budget (Array("d"), one slot per worker; rollout/worker_shares.py).
    worker_index: int = 0
    num_workers: int = 1
    committed_tokens: Any = None
    # The live servers when the worker was made (None: the config's vllm_server_base_url); later
    # changes come through servers_queue.
    server_urls: list[str] | None = None

    @classmethod
    def create(
        cls,
        context,
        initial_allowance: float = 0.0,
        worker_index: int = 0,
        num_workers: int = 1,
        committed_tokens: Any = None,
        server_urls: list[str] | None = None,
    ) -> WorkerChannels:
        """New channels from a multiprocessing context (the trainer's "spawn" context), owned by
        this process. Workers of one run share `committed_tokens`."""
        return cls(
            rollout_buffer=context.Queue(),
            metrics_queue=context.Queue(),
            timeline_queue=context.Queue(),
            exception_info_queue=context.Queue(),
            servers_queue=context.Queue(),
            failed_event=context.Event(),
            ready_event=context.Event(),
            start_event=context.Event(),
            model_version_value=context.Value("q", 0),
            token_allowance=context.Value("d", float(initial_allowance)),
            heartbeat_value=context.Value("d", 0.0),
            requests_running=context.Value("q", 0, lock=False),
            parent_pid=os.getpid(),
            worker_index=worker_index,
            num_workers=num_workers,
            committed_tokens=committed_tokens
            if committed_tokens is not None
            else context.Array("d", num_workers, lock=False),
            server_urls=server_urls,
        )

    def others_committed_tokens(self) -> float:
        """Tokens the other workers have committed against the staleness budget."""
        slots = self.committed_tokens
        return sum(slots[k] for k in range(self.num_workers) if k != self.worker_index)

    def publish_committed_tokens(self, tokens: float) -> None:
        self.committed_tokens[self.worker_index] = float(tokens)

    def report_failure(self, error: BaseException) -> None:
        """Worker side: send the error that stops the worker, then raise the failure flag (the
        trainer reads the error once it sees the flag)."""
        trace = "".join(traceback.format_exception(error))
        self.exception_info_queue.put((type(error).__name__, str(error), trace))
        self.failed_event.set()

    def close_worker_side(self) -> None:
        """Worker side, on the way out: do not wait to flush queued samples or metrics into pipes
        the trainer may no longer read; do wait for the error report, which must reach it."""
        self.rollout_buffer.cancel_join_thread()
        self.metrics_queue.cancel_join_thread()
        self.timeline_queue.cancel_join_thread()
        self.exception_info_queue.close()
        self.exception_info_queue.join_thread()

    def close_trainer_side(self) -> None:
        """Trainer side, once the worker is gone: nothing more is sent through the queues."""
        for channel in (
            self.rollout_buffer,
            self.metrics_queue,
            self.timeline_queue,
            self.exception_info_queue,
            self.servers_queue,
        ):
            channel.cancel_join_thread()
