"""Which servers a client sends its generation requests to, and which of them just failed.

The trainer decides which servers are live (trainer/server_roster.py) and hands each client its
servers: a rollout worker gets its share of the live ones (rollout/worker_shares.py), the trainer's
own client all of them. Each admission of a server into the live set gets a new number, so a client
can tell a server that was lost and given the weights again from the same server that never left.

A client adds what it sees itself, faster than the trainer can: a server that refused or dropped a
connection is avoided at once and the request goes to another one. It is tried again once the
trainer admits it anew, or, where no trainer watches (a client on its own), RETRY_DOWN_AFTER_S
later. A server leaving the live set takes its requests in flight with it: they are cancelled and
sent elsewhere (a server on a dead node never answers them, and would hold them until their
timeout).
"""

from __future__ import annotations

import asyncio
import itertools
import time

# A server that failed is tried again after this long when nobody re-admits it: long enough that the
# requests of a busy worker do not keep knocking at a closed port, short against a server's restart.
RETRY_DOWN_AFTER_S = 5.0


class ServerSet:
    def __init__(self, urls: list[str]):
        self.urls = list(urls)  # where requests may go
        self.admissions: dict[str, int] = dict.fromkeys(self.urls, 0)
        self.in_flight: dict[str, int] = dict.fromkeys(self.urls, 0)
        self._live = set(self.urls)  # servers whose requests in flight may finish
        self._down: dict[str, tuple[float, int]] = {}  # url -> (when it failed, its admission then)
        self._running: dict[str, set[asyncio.Task]] = {}  # requests in flight, by server
        self._dropped: set[asyncio.Task] = set()  # cancelled because their server left
        self._changed: asyncio.Event | None = None
        self._tie_breaker = itertools.count()

    def update(self, urls: list[str], admissions: dict[str, int], live: list[str] | None = None) -> None:
        """The trainer's new choice: requests go to `urls`; `live` (default: `urls`) are the servers
        still serving, whose requests in flight may finish (a server that moved to another worker's
        share keeps its); the requests in flight on any other are cancelled, to be sent elsewhere."""
        live_now = set(urls if live is None else live)
        for url in set(self._running) - live_now:
            for task in self._running.pop(url):
                self._dropped.add(task)
                task.cancel()
        for url, admission in admissions.items():
            failed = self._down.get(url)
            if failed is not None and admission > failed[1]:
                del self._down[url]  # admitted since it failed: the trainer gave it the weights again
        self.urls, self._live = list(urls), live_now
        self.admissions.update(admissions)
        for url in self.urls:
            self.in_flight.setdefault(url, 0)
        if self._changed is not None:
            self._changed.set()

    def mark_down(self, url: str) -> None:
        self._down[url] = (time.monotonic(), self.admissions.get(url, 0))

    def try_again(self, url: str) -> None:
        """Forget that `url` failed, so the next request goes to it: for an owner that tries a lost
        server again on a schedule of its own (a distillation teacher, rollout/teacher.py)."""
        self._down.pop(url, None)

    def usable(self) -> list[str]:
        now = time.monotonic()
        return [
            url
            for url in self.urls
            if url not in self._down or now - self._down[url][0] >= RETRY_DOWN_AFTER_S
        ]

    def pick(self) -> str | None:
        """The usable server with the fewest requests in flight from this client (ties in turn)."""
        usable = self.usable()
        if len(usable) <= 1:
            return usable[0] if usable else None
        lowest = min(self.in_flight[url] for url in usable)
        candidates = [url for url in usable if self.in_flight[url] == lowest]
        return candidates[next(self._tie_breaker) % len(candidates)]

    async def wait_for_change(self, timeout: float) -> None:
        """Until the trainer sends a new choice or `timeout` seconds pass (a failed server may be
        tried again by then)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def started(self, url: str, task: asyncio.Task) -> None:
        self.in_flight[url] = self.in_flight.get(url, 0) + 1
        self._running.setdefault(url, set()).add(task)

    def finished(self, url: str, task: asyncio.Task) -> None:
        self.in_flight[url] -= 1
        running = self._running.get(url)
        if running is not None:
            running.discard(task)

    def was_dropped(self, task: asyncio.Task) -> bool:
        """Whether this set cancelled `task` because its server left (and forget it)."""
        if task in self._dropped:
            self._dropped.discard(task)
            return True
        return False
