"""One live owner per directory: a lock file that names its owner, held while the owner lives.

A run's output_dir holds what two runs must never share (the weight files the servers reload, the
checkpoints, their rotation), and a weight sync's directory in /dev/shm is a run's own RAM. Either
gets an `OwnerLock`: a file created exclusively, holding its owner's record (pid, host, boot id, a
token unique to this acquisition, when it began), on which the owner holds an `flock` for as long
as it lives and whose mtime it refreshes every `HEARTBEAT_INTERVAL_S` (the heartbeat).

Whether the owner of an existing lock is gone (docs/reliability.md, "One live run per directory"):

- on this machine (same host name and same boot id): the flock decides. The kernel drops it when the
  process dies however it died, so this is exact, and pid reuse cannot fool it. Locks between
  processes of one machine work on NFS too (the client kernel sees its own locks);
- from another machine (or another boot of this one): the heartbeat decides. flock between NFS
  clients is not dependable (it depends on the mount and the lock daemon), while an mtime set by the
  file server is: the lock is stale once its mtime is older than `STALE_AFTER_S`, measured against
  the file server's own clock (a probe file's mtime), so clock skew between machines does not count.

On a filesystem without flock (some network and FUSE mounts) the heartbeat decides everywhere.
A stale lock is taken over in place, under its flock; a taker re-reads the record under the flock
and gives up if it changed, so two runs starting at once against one stale lock cannot both win on
one machine. Between machines a race within one heartbeat remains; the owner's heartbeat notices a
record that is no longer its own (`OwnerLock.lost`) and the trainer refuses to write a checkpoint
then.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from asyncgrpo.errors import CheckpointError

logger = logging.getLogger(__name__)

# How often an owner refreshes its lock's mtime: often enough that STALE_AFTER_S can stay short,
# rarely enough to cost nothing (one utime a beat).
HEARTBEAT_INTERVAL_S = 10.0
# A lock from another machine whose heartbeat stopped this long ago is stale: many missed beats, so
# a slow file server or a paused process is not taken for a dead one.
STALE_AFTER_S = 120.0
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


class DirectoryInUseError(CheckpointError, RuntimeError):
    """Another live owner holds the directory's lock."""


def boot_id() -> str:
    """This boot of this machine (Linux); '' where the kernel does not say."""
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class Owner:
    """What a lock file records about its owner."""

    pid: int
    host: str
    boot_id: str
    token: str  # unique to one acquisition: a takeover that raced another is seen
    since: float  # wall clock, when the lock was taken

    @classmethod
    def this_process(cls) -> Owner:
        return cls(os.getpid(), socket.gethostname(), boot_id(), uuid.uuid4().hex, time.time())

    def on_this_machine(self) -> bool:
        return self.host == socket.gethostname() and self.boot_id == boot_id()

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on host {self.host}, since {started}"


def read_owner(path: Path) -> Owner | None:
    """The record of the lock file at `path`; None when it is missing or not (yet) a record: its
    creator writes it right after creating the file."""
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
        return Owner(**fields)
    except (OSError, ValueError, TypeError):
        return None


def _filesystem_now(directory: Path) -> float:
    """The file server's clock: the mtime of a file just written in `directory`."""
    probe = directory / f".clock-{uuid.uuid4().hex}.partial"  # a leftover is cleared like any staging file
    try:
        probe.touch()
        return probe.stat().st_mtime
    except OSError:
        return time.time()
    finally:
        probe.unlink(missing_ok=True)


def _try_flock(fd: int) -> bool | None:
    """True: taken; False: another open file holds it; None: this filesystem has no flock (some
    network and FUSE mounts), where the heartbeat alone decides."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise


def owner_gone(path: Path, stale_after_s: float = STALE_AFTER_S) -> bool:
    """Whether the lock at `path` belongs to nobody alive (see the module's docstring). A missing file
    counts as gone; a record not written yet counts as alive until it is `stale_after_s` old."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        owner = read_owner(path)
        if owner is not None and owner.on_this_machine():
            taken = _try_flock(fd)  # taking it shows nobody holds it; closing the fd below lets it go
            if taken is not None:
                return taken
        age = _filesystem_now(path.parent) - os.fstat(fd).st_mtime
        return age > stale_after_s
    finally:
        os.close(fd)


class OwnerLock:
    """The lock of `directory` (the file `directory/name`), taken by `acquire` and held until
    `release` (or this process's end). `heartbeat_s=None`: no heartbeat (a directory only this
    machine uses)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        name: str,
        heartbeat_s: float | None = HEARTBEAT_INTERVAL_S,
        stale_after_s: float = STALE_AFTER_S,
    ):
        self.path = Path(directory) / name
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.owner: Owner | None = None
        self.lost = False  # the file no longer holds this owner's record (see the module's docstring)
        self._fd: int | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self, refusal: str = "") -> None:
        """Take the lock, or raise DirectoryInUseError naming its live owner (`refusal` is added to
        the message: what the caller should do). A stale lock is taken over, with a warning."""
        owner = Owner.this_process()
        for _ in range(3):  # a lock released or taken over while we looked: look again
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                if self._take_over(owner, refusal):
                    break
                continue
            if _try_flock(fd) is not False:
                self._own(fd, owner)
                break
            os.close(fd)  # a taker found it empty and holds it now: look again
        else:
            raise DirectoryInUseError(f"{self.path.parent}: could not take {self.path.name}. {refusal}")
        if self.heartbeat_s is not None:
            self._heartbeat = threading.Thread(target=self._beat, name="owner-lock-heartbeat", daemon=True)
            self._heartbeat.start()

    def _take_over(self, owner: Owner, refusal: str) -> bool:
        """True when the existing lock was stale and is now ours; raises when its owner lives; False
        when it changed under us (try again)."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return False
        found = read_owner(self.path)
        if not owner_gone(self.path, self.stale_after_s):
            os.close(fd)
            if found is None:  # its creator has not written its record yet
                raise DirectoryInUseError(f"{self.path.parent} is being taken by another run. {refusal}")
            raise DirectoryInUseError(
                f"{self.path.parent} is in use by another live run ({found.describe()}; lock file "
                f"{self.path}). {refusal}"
            )
        if _try_flock(fd) is False:
            os.close(fd)
            raise DirectoryInUseError(f"{self.path.parent} is being taken over by another run. {refusal}")
        if read_owner(self.path) != found:  # another taker won meanwhile
            os.close(fd)
            return False
        logger.warning(
            "%s: taking over the lock of a run that is gone (%s)",
            self.path.parent,
            found.describe() if found else "no record",
        )
        self._own(fd, owner)
        return True

    def _own(self, fd: int, owner: Owner) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(asdict(owner)).encode(), 0)
        os.fsync(fd)
        self._fd, self.owner, self.lost = fd, owner, False

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
                if read_owner(self.path) != self.owner:
                    raise FileNotFoundError(self.path)
            except OSError:
                if not self.lost:
                    logger.error(
                        "%s no longer holds this run's record: another run took the directory over. "
                        "This run writes no more checkpoints there.",
                        self.path,
                    )
                self.lost = True

    def held(self) -> bool:
        return self._fd is not None and not self.lost

    def release(self) -> None:
        """Remove the lock file and let the lock go (nothing when not held)."""
        self._let_go(remove=True)

    def abandon(self) -> None:
        """Let the lock go but leave its file, as a dead owner does: the next owner to come clears
        what this one leaves behind (`owner_gone` is true from now on)."""
        self._let_go(remove=False)

    def _let_go(self, remove: bool) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
            self._heartbeat = None
        if self._fd is None:
            return
        if remove and not self.lost and read_owner(self.path) == self.owner:
            self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = self.owner = None
        self._stop.clear()
