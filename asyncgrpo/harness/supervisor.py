"""The agent's supervisor: one small process per agent, between the rollout worker and the agent,
that ends every process the agent started, however it tried to leave.

`ProcessSession` runs it as `python -I -S supervisor.py LIFELINE_FD LOG_CAP_BYTES -- COMMAND...` with
the agent's environment, working directory and stdin, its stdout and stderr on the session's log
file, in a session of its own. It:

- marks itself a child subreaper (Linux's PR_SET_CHILD_SUBREAPER): a process that leaves its parent
  (a double fork, with `setsid` to leave the process group too) is re-parented to the supervisor
  rather than to init, so every process the agent left behind is still one of the supervisor's;
- starts the agent as its child, the agent's stdout and stderr through a pipe that it copies into
  the log, which it keeps under LOG_CAP_BYTES (the latest output: the oldest half goes when it is full);
- when the agent exits, on SIGTERM (the session is closing), or when the lifeline reaches end of file
  (a pipe whose write end only the session factory holds: the factory closed it, or the rollout
  worker died, even by SIGKILL), kills its children until it has none left. Killing a child
  re-parents that child's children to it, so the whole tree goes, `setsid` or not. Only the
  supervisor reaps its children, so none of the pids it kills can have been reused;
- exits with the agent's exit status (an agent killed by signal N: the supervisor by signal N).

Why not a cgroup: a cgroup would also catch an agent that kills its supervisor, but creating one
needs a writable cgroup hierarchy, which containers often do not offer. A sandboxed agent (the
default: the command is then bubblewrap's) cannot see its supervisor, and no process leaves its PID
namespace; an agent run with agent_sandbox="none" could kill its supervisor, and a process it had
moved out of the supervisor's process group would then survive (docs/harness.md, "The sandbox").

Standard library only, and no site packages (`-I -S`): it starts in milliseconds and holds little memory.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
READ_CHUNK = 1 << 16
# Signals Python ignores for itself, which a program it starts must get back at their defaults (as
# subprocess's restore_signals does): a shell pipeline in the agent relies on SIGPIPE.
RESTORED_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)


class CappedLog:
    """The session's log (an open, readable and writable descriptor), kept under `cap` bytes."""

    def __init__(self, fd: int, cap: int):
        self.fd, self.cap = fd, cap
        self.size = os.lseek(fd, 0, os.SEEK_END)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        self.size += len(data)
        if self.size > self.cap:
            keep = os.pread(self.fd, self.cap // 2, self.size - self.cap // 2)
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, keep, 0)
            self.size = os.lseek(self.fd, len(keep), os.SEEK_SET)


def become_subreaper() -> str | None:
    """None when this process is now a child subreaper, else why not."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0:
            return None
        return os.strerror(ctypes.get_errno())
    except (OSError, AttributeError) as error:  # not Linux
        return str(error)


def children() -> list[int]:
    """This process's children, zombies included (read from /proc: a child's stat names its parent)."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == me:
            found.append(int(entry))
    return found


def end_every_child() -> None:
    """Kill and reap the children until there are none: the children of each one killed become ours
    (a subreaper's) before waitpid returns it, so the next round finds them."""
    while pids := children():
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)  # not reaped yet: the pid is still this child's
            except ProcessLookupError:
                pass
        for pid in pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


class Supervisor:
    def __init__(self, lifeline: int, log: CappedLog, command: list[str]):
        self.lifeline, self.log, self.command = lifeline, log, command
        self.agent: int | None = None
        self.agent_status: int | None = None

    def run(self) -> int:
        wake_read, wake_write = os.pipe()
        for fd in (wake_read, wake_write):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(wake_write)  # a signal wakes poll() below: none is lost between two polls
        for signum in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(signum, lambda *_: None)
        problem = become_subreaper()
        if problem is not None:
            self.log.write(
                f"asyncgrpo supervisor: cannot catch processes that leave the agent ({problem})\n".encode()
            )
        output_read, output_write = os.pipe()
        try:
            self.agent = os.posix_spawnp(
                self.command[0],
                self.command,
                os.environ,
                file_actions=[(os.POSIX_SPAWN_DUP2, output_write, 1), (os.POSIX_SPAWN_DUP2, output_write, 2)],
                setsigdef=RESTORED_SIGNALS,
            )
        except OSError as error:
            self.log.write(
                f"asyncgrpo supervisor: cannot start the agent {self.command!r}: {error}\n".encode()
            )
            return 127
        finally:
            os.close(output_write)
        poller = select.poll()
        for fd in (wake_read, self.lifeline, output_read):
            poller.register(fd, select.POLLIN)
        stopping = False
        while self.agent_status is None and not stopping:
            for fd, _ in poller.poll():
                if fd == wake_read:
                    stopping |= signal.SIGTERM in os.read(wake_read, 512)
                elif fd == self.lifeline:
                    stopping = True  # nobody writes to it: readable means its writer is gone
                elif not self._copy_output(output_read):
                    poller.unregister(output_read)
            self._reap()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once ending, ending goes to its end
        end_every_child()
        self._reap()
        os.set_blocking(output_read, False)  # what the killed processes wrote, and no wait for more
        try:
            while self._copy_output(output_read):
                pass
        except BlockingIOError:  # a process outside the tree holds the pipe (no subreaper here)
            pass
        return self._exit_code()

    def _copy_output(self, fd: int) -> bool:
        data = os.read(fd, READ_CHUNK)
        if data:
            self.log.write(data)
        return bool(data)

    def _reap(self) -> None:
        """Reap every child that has exited (the agent, and the orphans given to this subreaper)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.agent:
                self.agent_status = status

    def _exit_code(self) -> int:
        if self.agent_status is None:
            return 1
        if os.WIFSIGNALED(self.agent_status):
            signum = os.WTERMSIG(self.agent_status)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # the worker sees the agent's own end; a signal that does not
            return 128 + signum  # end a process (none the agent could die of) leaves the shell's code
        return os.waitstatus_to_exitcode(self.agent_status)


def main(argv: list[str]) -> int:
    lifeline, cap, separator, *command = argv[1:]
    if separator != "--" or not command:
        raise SystemExit("usage: supervisor.py LIFELINE_FD LOG_CAP_BYTES -- COMMAND...")
    os.set_inheritable(int(lifeline), False)  # the agent does not get it
    return Supervisor(int(lifeline), CappedLog(1, int(cap)), command).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
