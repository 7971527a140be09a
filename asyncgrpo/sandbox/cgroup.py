"""The bound on a sandbox's processes when the trainer runs as root: a cgroup of the pids controller.

Unprivileged, `processes` is RLIMIT_NPROC, which the kernel counts per user of each user namespace
(asyncgrpo/sandbox/limits.py). But the kernel never applies RLIMIT_NPROC to the root user, and a
root trainer's sandbox user is root outside its namespace (bubblewrap maps it to the user that runs
it). So as root each sandbox gets a cgroup of its own, `pids.max` = `processes`, which it enters
before bubblewrap starts: the command becomes `sh -c 'echo $$ > CGROUP/cgroup.procs && exec "$@"'
bwrap ...`, and every process of the sandbox is born in the cgroup. Root may make cgroups wherever
the cgroup file system is mounted writable (a VM, a CI machine, a node); both cgroup v2 and the v1
`pids` hierarchy are used. The sandbox's cgroup namespace has it as its root, so it sees nothing
above it.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path

from asyncgrpo.sandbox.errors import SandboxUnavailableError

ENTER = 'echo $$ > "$0" && exec "$@"'
# How long removing a cgroup waits for its last process to be reaped (a bound: it takes milliseconds).
RELEASE_BOUND_S = 10.0
_names = itertools.count()
_base: Path | None = None
_base_lock = threading.Lock()


def needs_cgroup() -> bool:
    """Whether processes must be bounded by a cgroup: RLIMIT_NPROC does not hold for root."""
    return os.geteuid() == 0


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(root within the hierarchy, mount point, file system type, super options) of each cgroup mount."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if tail and tail[0] in ("cgroup", "cgroup2"):
            found.append((fields[3], fields[4], tail[0], set(tail[2].split(","))))
    return found


def _folder(mount_root: str, mount_point: str, path: str) -> Path | None:
    relative = os.path.relpath(path, mount_root)
    return None if relative.startswith("..") else Path(mount_point, relative)


def _find_base() -> Path:
    """The folder under which sandbox cgroups are made: our own cgroup's folder in the v1 `pids`
    hierarchy, or in cgroup v2 our cgroup's parent (v2 lets no cgroup with processes, ours, have
    children with controllers; the root cgroup may)."""
    mounts = _mounts()
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers:
            if "pids" not in controllers.split(","):
                continue
            for root, point, kind, options in mounts:
                if kind == "cgroup" and "pids" in options and (folder := _folder(root, point, path)):
                    return folder
            continue
        for root, point, kind, _ in mounts:
            folder = _folder(root, point, path) if kind == "cgroup2" else None
            if folder is None:
                continue
            base = folder if folder == Path(point) else folder.parent
            if "pids" not in (base / "cgroup.controllers").read_text().split():
                continue  # a v2 hierarchy beside v1 controllers (hybrid), without pids
            if "pids" not in (base / "cgroup.subtree_control").read_text().split():
                (base / "cgroup.subtree_control").write_text("+pids")
            return base
    raise OSError("no cgroup hierarchy with the pids controller is mounted")


def cgroup_base() -> Path:
    global _base
    with _base_lock:
        if _base is None:
            try:
                _base = _find_base()
            except OSError as error:
                raise SandboxUnavailableError(
                    "the trainer runs as root, where the kernel does not apply RLIMIT_NPROC, so the sandbox "
                    "bounds its processes with a cgroup of the pids controller, and none can be made here "
                    f"({error}): mount the cgroup file system writable (cgroup v2, or v1's pids hierarchy), "
                    "or run the trainer as an unprivileged user (docs/harness.md, 'The sandbox')"
                ) from error
        return _base


class SandboxCgroup:
    """One sandbox's cgroup: made with its bound, entered by the sandbox's command, removed once
    the sandbox has ended."""

    def __init__(self, processes: int):
        self.path = cgroup_base() / f"asyncgrpo-sandbox-{os.getpid()}-{next(_names)}"
        try:
            self.path.mkdir()
            (self.path / "pids.max").write_text(str(processes))
        except OSError as error:
            self.remove()
            raise SandboxUnavailableError(
                f"cannot make the sandbox's cgroup {self.path} ({error}): the cgroup file system must be "
                "writable for a trainer that runs as root (docs/harness.md, 'The sandbox')"
            ) from error

    def enter(self, argv: list[str]) -> list[str]:
        """`argv`, run from inside this cgroup."""
        return ["/bin/sh", "-c", ENTER, str(self.path / "cgroup.procs"), *argv]

    def remove(self) -> None:
        """Remove the cgroup, once empty: the sandbox's init may still be on its way out (bubblewrap's
        monitor leaves it to be reaped by whoever inherits it), for as long as one reap takes."""
        deadline = time.monotonic() + RELEASE_BOUND_S
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:  # still holds a process: EBUSY
                if time.monotonic() > deadline:
                    return  # left behind, empty once its last process is reaped; never reused
                time.sleep(0.01)
