"""A rollout worker's servers: its share of the run's live servers, and how many rollouts they may run.

The trainer decides which servers are live (trainer/server_roster.py) and sends every change; the
worker takes its share (rollout/worker_shares.py) and hands it to its client, which sends the
requests in flight on a server that left to the others (generation/server_set.py). The load-driven
cap on running rollouts (docs/architecture.md, "Three limits on generation") was learned on the
servers of the share, so it scales with their number when the share changes, and the `/metrics`
polls move it from there.
"""

from __future__ import annotations

import asyncio
import logging
import queue
from typing import Callable

from asyncgrpo.generation.client import VLLMClient, VLLMUnavailableError
from asyncgrpo.generation.server_list import starting_servers
from asyncgrpo.records.metrics import MetricsWindow, Reduce
from asyncgrpo.rollout.channels import WorkerChannels
from asyncgrpo.rollout.concurrency import RolloutSlots, initial_cap, next_cap, rescaled_cap
from asyncgrpo.rollout.worker_shares import worker_servers

logger = logging.getLogger(__name__)

# How often the worker looks for a change of the run's servers: small against a server's loss or
# start-up, cheap for the event loop.
SERVERS_POLL_INTERVAL_S = 0.25


def initial_servers(channels: WorkerChannels, configured: list[str]) -> list[str]:
    """The worker's share of the servers live when it was made (the config's without a trainer)."""
    return worker_servers(
        starting_servers(configured, handed=channels.server_urls or ()),
        channels.worker_index,
        channels.num_workers,
    )


class ServerShare:
    def __init__(
        self,
        client: VLLMClient,
        channels: WorkerChannels,
        max_concurrent_rollouts: int,
        stall_timeout_s: float,
        metrics: Callable[[], MetricsWindow],
        describe_waits: Callable[[], str] = lambda: "",
    ):
        self.client = client
        self.channels = channels
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self.stall_timeout_s = stall_timeout_s  # RolloutSlots: no rollout finishing for that long
        self.metrics = metrics  # the loop's current window (replaced at each flush)
        self.describe_waits = describe_waits  # what running rollouts wait on, for a stuck-generation error
        self.cap = max_concurrent_rollouts
        self.finished_since_raise = 0  # rollouts finished since the cap last grew
        self.slots: RolloutSlots | None = None
        self._last_preemptions = 0
        self._load_failing = False  # the last load poll got no answer
        self._cap_servers = len(client.base_urls)  # the number of servers the cap was learned on

    async def start(self, max_model_len: int) -> None:
        """The starting cap, from the servers' KV capacity, and the slots it limits."""
        load = await self.client.load()
        self.cap = initial_cap(
            load.kv_cache_tokens if load else 0, max_model_len, self.max_concurrent_rollouts
        )
        self.slots = RolloutSlots(
            min(self.cap, self.max_concurrent_rollouts), self.stall_timeout_s, self.describe_waits
        )
        self._last_preemptions = load.preemptions if load else 0

    async def servers_loop(self) -> None:
        """Take each change of the run's servers the trainer sends."""
        while True:
            latest = None
            try:
                while True:
                    latest = self.channels.servers_queue.get_nowait()
            except queue.Empty:
                pass
            if latest is not None:
                await self.apply(*latest)
            await asyncio.sleep(SERVERS_POLL_INTERVAL_S)

    async def apply(self, live: list[str], admissions: dict[str, int]) -> None:
        """The run's live servers are now `live`: requests go to this worker's share of them, the cap
        follows the share's size."""
        channels = self.channels
        mine = worker_servers(live, channels.worker_index, channels.num_workers) if live else []
        if mine != self.client.base_urls:
            logger.info("rollout worker %d now sends its requests to %s", channels.worker_index, mine)
        self.client.set_servers(mine, admissions, live)
        if mine:
            await self._set_cap(
                rescaled_cap(self.cap, self._cap_servers, len(mine), self.max_concurrent_rollouts)
            )
            self._cap_servers = len(mine)

    async def load_loop(self, interval_s: float) -> None:
        """Read the servers' load now and every `interval_s`, and move the cap."""
        while True:
            try:
                load = await self.client.load()
            except VLLMUnavailableError as error:
                # No server answers (lost, restarting): keep the cap. Generation waits for a server,
                # within vllm_server_timeout, and fails naming them if none comes back. Said once a
                # streak: the loss itself is reported where it is noticed.
                if not self._load_failing:
                    logger.warning("reading the vLLM servers' load: %s; keeping the concurrency cap", error)
                self._load_failing = True
                await asyncio.sleep(interval_s)
                continue
            self._load_failing = False
            if load is None:
                cap = self.max_concurrent_rollouts
            else:
                cap, raised = next_cap(
                    self.cap, load, self.finished_since_raise, self.max_concurrent_rollouts
                )
                if raised:
                    self.finished_since_raise = 0
                metrics = self.metrics()
                metrics.record("rollout/vllm_kv_cache_usage_frac", load.kv_cache_usage)
                metrics.record("rollout/vllm_running_requests", load.running)
                metrics.record("rollout/vllm_queued_requests", load.waiting)
                metrics.record(
                    "rollout/vllm_preemption_count",
                    max(0, load.preemptions - self._last_preemptions),
                    Reduce.SUM,
                )
                self._last_preemptions = load.preemptions
            await self._set_cap(cap)
            await asyncio.sleep(interval_s)

    async def _set_cap(self, cap: int) -> None:
        if cap != self.cap:
            self.cap = cap
            await self.slots.set_limit(cap)
