"""What the running rollouts are waiting on, for the error that says generation is stuck.

A rollout that never finishes holds its place, and when every place is held that way the scheduler
stops the run ("generation is stuck", rollout/concurrency.py). Which call the rollouts are stuck in
is what the user needs to fix it: a tool, a harness's `verify`, an agent. Code that waits on user
code writes what it waits on here for the time of the wait (`with board.waiting_on("tool 'search'")`),
from any thread; the error reads `describe()`.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class ActivityBoard:
    def __init__(self):
        self._lock = threading.Lock()
        self._waits: dict[int, tuple[str, float]] = {}
        self._ids = itertools.count()

    @contextmanager
    def waiting_on(self, what: str) -> Iterator[None]:
        key = next(self._ids)
        with self._lock:
            self._waits[key] = (what, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                del self._waits[key]

    def describe(self, now: float | None = None) -> str:
        """E.g. "3 waiting on verify for up to 1805 s, 1 on tool 'search' for 12 s" (the longest
        wait first); "" when nothing is registered."""
        now = time.monotonic() if now is None else now
        with self._lock:
            waits = list(self._waits.values())
        longest: dict[str, float] = {}
        counts: dict[str, int] = {}
        for what, since in waits:
            longest[what] = max(longest.get(what, 0.0), now - since)
            counts[what] = counts.get(what, 0) + 1
        parts = []
        for index, what in enumerate(sorted(longest, key=longest.__getitem__, reverse=True)):
            count, seconds = counts[what], longest[what]
            span = f"for up to {seconds:.0f} s" if count > 1 else f"for {seconds:.0f} s"
            parts.append(f"{count} {'waiting on ' if index == 0 else 'on '}{what} {span}")
        return ", ".join(parts)
