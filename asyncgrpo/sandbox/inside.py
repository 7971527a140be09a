"""The sandbox's first process: it runs inside bubblewrap as
`python -I -S launcher.py CONFIG -- COMMAND...` (asyncgrpo/sandbox/bubblewrap.py builds that line)
and

- listens on 127.0.0.1:PORT of the sandbox's own network namespace, where nothing else can reach
  (CONFIG's "proxy", when given), before the command starts, so its first request finds the port
  open;
- starts COMMAND as its child, with CONFIG's resource limits set as hard limits the command
  cannot raise (a fork past `processes` fails, a file past `file_bytes` fails, ...) and the signals
  Python ignores for itself back at their defaults (a shell pipeline relies on SIGPIPE);
- copies bytes between each connection to that port and the capture proxy's Unix socket, bound
  into the sandbox, until the command exits: the sandbox's only way out. One thread: an agent that
  opens many connections costs file descriptors (bounded), never threads;
- exits with the command's exit code (128 + N for a command killed by signal N). Bubblewrap's init
  then ends, and the kernel kills every process left in the sandbox's PID namespace.

The command runs under the same user: it can stop or kill this process, which only cuts its own
connection to the model (killing it ends the sandbox). What it cannot do is reach this process's
limits, which bound the command, not this process.

Standard library only, no site packages (`-I -S`): it starts in milliseconds and reads nothing of
the trainer.
"""

from __future__ import annotations

import json
import os
import resource
import selectors
import signal
import socket
import sys

RLIMITS = {
    "memory_bytes": resource.RLIMIT_AS,
    "processes": resource.RLIMIT_NPROC,
    "cpu_seconds": resource.RLIMIT_CPU,
    "file_bytes": resource.RLIMIT_FSIZE,
    "open_files": resource.RLIMIT_NOFILE,
}
# Between the CPU limit's SIGXCPU (which a program may catch, to save its work) and the SIGKILL.
CPU_GRACE_S = 5
# Signals Python ignores for itself, which a program it starts must get back at their defaults.
RESTORED_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)
CHUNK = 1 << 16


def limit(limits: dict[str, int]) -> None:
    """Set `limits` (SandboxLimits' fields, disk_bytes aside: measured from outside) as hard limits."""
    for name, value in limits.items():
        if name in RLIMITS:
            hard = value + CPU_GRACE_S if name == "cpu_seconds" else value
            resource.setrlimit(RLIMITS[name], (value, hard))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core dumps filling the disk


def start(command: list[str], limits: dict[str, int], keep_open: list[socket.socket]) -> int:
    """Fork and exec `command` under `limits`; its pid."""
    pid = os.fork()
    if pid:
        return pid
    try:
        for sock in keep_open:
            sock.close()
        limit(limits)
        for signum in RESTORED_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        os.execvp(command[0], command)
    except BaseException as error:  # noqa: BLE001 -- the child must never return into the parent's loop
        os.write(2, f"asyncgrpo sandbox: cannot start {command!r}: {error}\n".encode())
    os._exit(127)


class Bridge:
    """Connections to the listening port, each joined to a connection of its own to the Unix socket."""

    def __init__(self, selector: selectors.BaseSelector, listener: socket.socket, upstream: str):
        self.selector, self.listener, self.upstream = selector, listener, upstream
        self.peer: dict[socket.socket, socket.socket] = {}
        self.ended: set[socket.socket] = set()  # sockets whose reading side reached end of file
        self.dropping: set[socket.socket] = set()  # sockets whose peer no longer takes what they send
        listener.setblocking(False)
        selector.register(listener, selectors.EVENT_READ, self.accept)

    def accept(self) -> None:
        try:
            client, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # out of descriptors: refuse this one, keep serving the others
            return
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(self.upstream)
        except OSError as error:
            os.write(2, f"asyncgrpo sandbox: the capture proxy cannot be reached: {error}\n".encode())
            client.close()
            upstream.close()
            return
        client.setblocking(True)
        for one, other in ((client, upstream), (upstream, client)):
            self.peer[one] = other
            self.selector.register(one, selectors.EVENT_READ, lambda one=one: self.relay(one))

    def relay(self, source: socket.socket) -> None:
        """Copy what `source` has to its peer (a blocking send: only this sandbox's own connections
        wait on a slow reader); at end of file, pass the end on and close the pair once both ended.
        A peer that stops reading (the proxy refusing a body too large with a 413) gets nothing more,
        and the rest is read and dropped: the sender finishes sending and then reads the answer."""
        target = self.peer[source]
        try:
            data = source.recv(CHUNK)
        except OSError:
            self.close(source)
            return
        if data:
            if source not in self.dropping:
                try:
                    target.sendall(data)
                except OSError:
                    self.dropping.add(source)
            return
        try:
            target.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.selector.unregister(source)
        self.ended.add(source)
        if target in self.ended:
            self.close(source)

    def close(self, one: socket.socket) -> None:
        for sock in (one, self.peer.get(one)):
            if sock is None or sock not in self.peer:
                continue
            if sock not in self.ended:
                self.selector.unregister(sock)
            self.ended.discard(sock)
            self.dropping.discard(sock)
            del self.peer[sock]
            sock.close()


def exit_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status)


def main(argv: list[str]) -> int:
    config, separator, *command = argv[1:]
    if separator != "--" or not command:
        raise SystemExit("usage: launcher.py CONFIG -- COMMAND...")
    settings = json.loads(config)
    proxy = settings.get("proxy")
    listener = None
    if proxy is not None:
        listener = socket.create_server(("127.0.0.1", proxy["port"]), backlog=128)
    child = start(command, settings["limits"], [listener] if listener else [])
    selector = selectors.DefaultSelector()
    child_exit = os.pidfd_open(child)  # readable once the command has exited
    selector.register(child_exit, selectors.EVENT_READ, None)
    if listener is not None:
        Bridge(selector, listener, proxy["socket"])
    while True:
        for key, _ in selector.select():
            if key.data is None:
                return exit_code(os.waitpid(child, 0)[1])
            key.data()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
