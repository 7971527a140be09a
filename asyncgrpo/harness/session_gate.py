"""SessionGate: at most `limit` harness sessions alive at once in a rollout loop.

A session factory that starts a process per session (ProcessSessionFactory) says how many the
machine runs at once (`max_live_sessions`); rollouts beyond it wait here for a place, on the event
loop, before their session is created. Waiting holds generation back, which the log says (at most
once per LOG_INTERVAL_S) and `rollout/harness_session_wait_s` measures: a bound set too low shows as
an idle server.
"""

from __future__ import annotations

import asyncio
import logging
import time

logger = logging.getLogger(__name__)

# How often the log may repeat that sessions wait for a place.
LOG_INTERVAL_S = 60.0


class SessionGate:
    def __init__(self, limit: int | None, what: str = "max_agents"):
        """`limit`: sessions alive at once (None: no bound); `what`: the setting that sets it."""
        self.limit = limit
        self.what = what
        self.waiting = 0
        self._places = asyncio.Semaphore(limit) if limit is not None else None
        self._logged_at = -LOG_INTERVAL_S

    async def acquire(self) -> float:
        """Take a place for one session (give it back with `release()`); the seconds waited for it."""
        if self._places is None:
            return 0.0
        started = time.monotonic()
        if self._places.locked():
            self._note_holding_back()
        self.waiting += 1
        try:
            await self._places.acquire()
        finally:
            self.waiting -= 1
        return time.monotonic() - started

    def release(self) -> None:
        if self._places is not None:
            self._places.release()

    def _note_holding_back(self) -> None:
        now = time.monotonic()
        if now - self._logged_at < LOG_INTERVAL_S:
            return
        self._logged_at = now
        logger.warning(
            "holding generation back: %d harness sessions are alive, the most this machine runs at once "
            "(%s), and %d more rollouts wait for a place; raise %s if the machine has room "
            "(rollout/harness_session_wait_s: how long they wait)",
            self.limit,
            self.what,
            self.waiting + 1,
            self.what,
        )
