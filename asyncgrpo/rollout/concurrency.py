"""The three limits on how many rollouts run (docs/architecture.md, "Three limits on generation").

1. Staleness budget, in tokens (`TokenAllowance`): the trainer publishes a cumulative limit on the
   tokens the worker may have produced; queued plus in-flight tokens must stay under it. Until the
   first group finishes nobody knows a rollout's size, so groups start one at a time.
2. vLLM load (`next_cap`): a cap on running rollouts, started from KV capacity / max_model_len and
   moved every 5 s from the server's `/metrics`.
3. `max_concurrent_rollouts`, the user's bound (what environments and tools can take).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from asyncgrpo.errors import RolloutError
from asyncgrpo.generation.server_load import ServerLoad

RAISE_BELOW_KV_USAGE = 0.60
LOWER_ABOVE_KV_USAGE = 0.80
RAISE_FACTOR = 1.25
LOWER_FACTOR = 0.70
LOAD_POLL_INTERVAL_S = 5.0


def initial_cap(kv_cache_tokens: int, max_model_len: int, max_concurrent_rollouts: int) -> int:
    """As many requests as fit in the KV cache at full length: the server is never overloaded at
    start. Unknown capacity (no /metrics): the user's bound."""
    if kv_cache_tokens <= 0 or max_model_len <= 0:
        return max_concurrent_rollouts
    return max(1, min(max_concurrent_rollouts, kv_cache_tokens // max_model_len))


def next_cap(
    cap: int, load: ServerLoad, finished_since_raise: int, max_concurrent_rollouts: int
) -> tuple[int, bool]:
    """One adjustment from a `/metrics` reading: returns (new cap, whether it was raised).

    Above 80% KV usage the cap drops by 30% (running requests continue; new ones wait). Below 60%
    with nothing waiting it grows by 25%, at most once per cap's worth of finished rollouts, so a
    raise is judged on a server that actually ran at the previous cap.
    """
    if load.kv_cache_usage > LOWER_ABOVE_KV_USAGE:
        return max(1, math.floor(cap * LOWER_FACTOR)), False
    if load.kv_cache_usage < RAISE_BELOW_KV_USAGE and load.waiting == 0 and finished_since_raise >= cap:
        return min(max_concurrent_rollouts, max(cap + 1, math.ceil(cap * RAISE_FACTOR))), True
    return min(cap, max_concurrent_rollouts), False


def rescaled_cap(cap: int, servers_before: int, servers_after: int, max_concurrent_rollouts: int) -> int:
    """The cap when a worker's servers go from `servers_before` to `servers_after`: the load-driven cap
    was learned on that many servers, so it scales with their number (the polls move it from there).
    With no server before or after it stays: nothing can run, and it is where the servers restart."""
    if servers_before <= 0 or servers_after <= 0:
        return cap
    return max(1, min(max_concurrent_rollouts, round(cap * servers_after / servers_before)))


class TokenAllowance:
    """Worker-side bookkeeping of the staleness budget.

    `produced` counts the tokens of samples queued for training (what the trainer will consume);
    a group in flight is estimated at `num_generations` x the mean tokens per rollout seen so far
    (rollouts that made tokens: until one has, groups start one at a time).
    """

    def __init__(self, num_generations: int):
        self.num_generations = num_generations
        self.produced_tokens = 0
        self.groups_in_flight = 0
        self._rollout_tokens = 0
        self._rollouts = 0

    @property
    def tokens_per_group_estimate(self) -> float | None:
        if self._rollouts == 0:
            return None
        return self._rollout_tokens / self._rollouts * self.num_generations

    @property
    def committed_tokens(self) -> float:
        """Queued tokens plus the estimate of the groups in flight: what this worker holds against
        the budget (other workers read it to share one budget)."""
        estimate = self.tokens_per_group_estimate
        return self.produced_tokens + self.groups_in_flight * (estimate or 0.0)

    def may_start_group(self, limit: float, others_committed: float = 0.0) -> bool:
        """`others_committed`: what other rollout workers hold against the same `limit`."""
        if self.tokens_per_group_estimate is None:
            return self.groups_in_flight == 0
        return self.committed_tokens + others_committed < limit

    def group_started(self) -> None:
        self.groups_in_flight += 1

    def group_finished(self, rollout_tokens: list[int], queued_tokens: int) -> None:
        """A group left generation: its rollouts' sizes refine the estimate; `queued_tokens` (0 for a
        dropped group) now wait for the trainer. A rollout of no tokens (an agent that failed before
        its first turn) says nothing of a rollout's size: counted as 0, failures would drive the estimate
        to 0 and let groups start without limit, each a set of processes for a harness."""
        self.groups_in_flight -= 1
        sized = [tokens for tokens in rollout_tokens if tokens > 0]
        self._rollout_tokens += sum(sized)
        self._rollouts += len(sized)
        self.produced_tokens += queued_tokens


class RolloutSlots:
    """At most `limit` rollouts generate at once; `limit` = min(adaptive cap, max_concurrent_rollouts).

    A group reserves its rollouts' places when it starts (synchronously), so the generate loop
    sees them before their tasks run and never starts more groups than there is room for.
    """

    def __init__(
        self, limit: int, stall_timeout_s: float = math.inf, describe_waits: Callable[[], str] = lambda: ""
    ):
        self.limit = limit
        self.running = 0
        self.waiting = 0
        self.reserved = 0
        # No rollout finishing for this long means generation is stuck (every request is bounded
        # by vllm_server_timeout): waiting for a place then fails instead of hanging.
        self.stall_timeout_s = stall_timeout_s
        # What the running rollouts wait on (rollout/activity.py), for the error to name it.
        self.describe_waits = describe_waits
        self._changed = asyncio.Condition()

    async def _wait(self, predicate, what: str) -> None:
        try:
            await asyncio.wait_for(
                self._changed.wait_for(predicate),
                None if math.isinf(self.stall_timeout_s) else self.stall_timeout_s,
            )
        except asyncio.TimeoutError:
            waits = self.describe_waits()
            state = (
                f"of the running rollouts, {waits}; the others wait on the server or the loop's own code"
                if waits
                else "a server or a tool that never answers?"
            )
            raise RolloutError(
                f"waited {self.stall_timeout_s:g} s {what} but none of the {self.running} running rollouts "
                f"finished: generation is stuck ({state})"
            ) from None

    def reserve(self, count: int) -> None:
        self.reserved += count

    async def acquire(self) -> None:
        """Take a running place (consuming one reservation)."""
        async with self._changed:
            self.reserved -= 1
            self.waiting += 1
            try:
                await self._wait(lambda: self.running < self.limit, "for a place to run a rollout")
            finally:
                self.waiting -= 1
            self.running += 1

    async def release(self) -> None:
        async with self._changed:
            self.running -= 1
            self._changed.notify_all()

    async def set_limit(self, limit: int) -> None:
        async with self._changed:
            self.limit = limit
            self._changed.notify_all()

    async def wait_for_room(self) -> None:
        """Until a new group's rollouts could start without queueing behind others."""
        async with self._changed:
            await self._wait(
                lambda: self.running + self.waiting + self.reserved < self.limit, "for room to start a group"
            )
