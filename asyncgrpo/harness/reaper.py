"""GroupReaper: the agents' process groups end when the rollout worker that started them dies, even
by SIGKILL (which runs no clean-up of the worker's own).

A session's agent leads a process group of its own (so that closing the session ends the agent and
every process it started), which also means nothing ends it when its parent dies. The reaper is a
small process per session factory, started in a session of its own (a signal to the worker's group
does not reach it). The factory writes each agent's group id to the reaper's stdin when it starts
and `-id` when the session has ended it. When the stdin reaches end of file (the factory closed it,
or the kernel did because the worker died: no other process holds the pipe's write end, which is
not inheritable), the reaper SIGKILLs every group still registered, and exits.

Why not the kernel's parent-death signal (PR_SET_PDEATHSIG): it reaches only the direct child, not
the processes the agent starts itself, and it fires when the thread that started the child exits,
not the process (sessions start on pool threads).

Run as a script (`python -I reaper.py`), this file imports nothing but the standard library: the
reaper starts in milliseconds and holds no memory of the worker's.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading

logger = logging.getLogger(__name__)


class GroupReaper:
    """One reaper process; `watch(pgid)` / `forget(pgid)` from any thread; `close()` ends it (after
    ending the groups still watched)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._broken = False

    def watch(self, pgid: int) -> None:
        self._send(pgid)

    def forget(self, pgid: int) -> None:
        self._send(-pgid)

    def close(self) -> None:
        with self._lock:
            if self._process is None:
                return
            try:
                self._process.stdin.close()
            except BrokenPipeError:
                pass
            self._process.wait()
            self._process = None

    def _send(self, value: int) -> None:
        with self._lock:
            if self._broken:
                return
            if self._process is None:
                # -I: isolated, so this file's folder (asyncgrpo/harness, which holds a trace.py) is not
                # on the reaper's path, nor are the user's site-packages.
                self._process = subprocess.Popen(
                    [sys.executable, "-I", os.path.abspath(__file__)],
                    stdin=subprocess.PIPE,
                    start_new_session=True,
                )
            try:
                self._process.stdin.write(f"{value}\n".encode())
                self._process.stdin.flush()
            except BrokenPipeError:
                # Someone ended the reaper: sessions still end their agents on close, only a SIGKILL of
                # the worker would leave them behind now.
                self._broken = True
                logger.warning(
                    "the harness agents' reaper process (pid %d) has exited: agents will not be ended "
                    "if this rollout worker is killed outright",
                    self._process.pid,
                )


def reap(lines) -> None:
    """The reaper's loop: register and forget group ids until end of input, then kill those left."""
    groups: set[int] = set()
    for line in lines:
        value = int(line)
        if value > 0:
            groups.add(value)
        else:
            groups.discard(-value)
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # already gone (or, reused by another user's group, not ours to end)


if __name__ == "__main__":
    reap(sys.stdin.buffer)
