"""A private event loop in a daemon thread, so synchronous code (the training loop) can await the
async vLLM client without owning an event loop of its own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    """`default_timeout_s` bounds every `run` that gives no timeout of its own: the coroutines run
    here have deadlines of their own, and this is the outer guarantee that no caller waits forever."""

    def __init__(self, name: str = "asyncgrpo-http", default_timeout_s: float = 3600.0):
        self.default_timeout_s = default_timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop and wait for its result (its exception is re-raised here)."""
        name = getattr(coroutine, "__qualname__", repr(coroutine))
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        bound = self.default_timeout_s if timeout is None else timeout
        try:
            return future.result(bound)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{name} did not finish within {bound:g} s") from None

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start a coroutine on the loop without waiting for it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()
