"""`python -m asyncgrpo.generation.guard PARENT_PID -- COMMAND...`: run COMMAND (a vLLM server) so
that it never outlives the process that launched it.

A vLLM server holds gigabytes of memory and several processes. It runs in a process group of its
own (so that stopping it reaches its engine processes), which also means a SIGKILL of its launcher,
or of the launcher's process group, does not reach it. This small guard closes that gap: it is the
group's leader, starts the server (with the Linux parent-death signal, so the server also goes if the
guard itself is killed), and watches the launcher's pid. When the launcher is gone, however it died,
the guard stops the server's group: SIGTERM, then SIGKILL after `STOP_GRACE_S`. SIGTERM or SIGINT
sent to the guard reach the server the same way. The guard exits with the server's exit code.
Standard library only: it starts in a fraction of a second.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PARENT_POLL_S = 0.5
STOP_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1


def _die_with_guard() -> None:
    """In the server's process, before exec: SIGTERM it when the guard dies (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _stop_group(server: subprocess.Popen) -> int:
    """SIGTERM the whole group (the server and its engine processes), SIGKILL after the grace."""
    _signal_group(signal.SIGTERM)
    try:
        return server.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_group(signal.SIGKILL)
        return server.wait()


def _signal_group(sig: int) -> None:
    try:
        os.killpg(os.getpgrp(), sig)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m asyncgrpo.generation.guard PARENT_PID -- COMMAND...", file=sys.stderr)
        return 2
    parent_pid, command = int(argv[0]), argv[2:]
    if os.getpgrp() != os.getpid():
        os.setpgrp()  # the group this guard stops is its own
    stopping = {"requested": False}

    def forward(signum, _frame) -> None:
        stopping["requested"] = True

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    server = subprocess.Popen(command, preexec_fn=_die_with_guard)
    while True:
        code = server.poll()
        if code is not None:
            return code
        if stopping["requested"] or os.getppid() != parent_pid:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM is for the server
            return _stop_group(server)
        time.sleep(PARENT_POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
