"""The share of time generation had nothing to do: no rollout running (`perf/generation_idle_frac`).

The worker counts the seconds during which none of its rollouts was running, between two metric
flushes; the trainer adds the seconds its weight syncs froze running requests (docs/metrics.md,
"Overlap").
"""

from __future__ import annotations


class IdleClock:
    """Seconds with no rollout running, read and restarted by `take`. Times are the caller's clock."""

    def __init__(self, now: float):
        self.running = 0
        self._idle_since = now  # when the last rollout finished (meaningful while none runs)
        self._idle_s = 0.0
        self._window_start = now

    def started(self, now: float) -> None:
        if self.running == 0:
            self._idle_s += now - self._idle_since
        self.running += 1

    def finished(self, now: float) -> None:
        self.running -= 1
        if self.running == 0:
            self._idle_since = now

    def take(self, now: float) -> tuple[float, float]:
        """(idle seconds, elapsed seconds) since the last take."""
        idle_s = self._idle_s
        if self.running == 0:
            idle_s += now - self._idle_since
            self._idle_since = now
        elapsed_s = now - self._window_start
        self._idle_s, self._window_start = 0.0, now
        return idle_s, elapsed_s
