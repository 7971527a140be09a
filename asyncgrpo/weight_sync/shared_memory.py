"""Filesystem weight sync through RAM: the same safetensors and the same reload as `filesystem`, but
written to RAM-backed storage (Linux's `/dev/shm`) instead of `output_dir`, for servers on this
machine. Nothing reaches a disk: a version is written at memory speed, the server reads it through the
page cache it already lives in, and the previous version's pages are freed once the servers moved on.

Each run owns one directory there and holds its lock (asyncgrpo/run/lock.py, the scheme that also
keeps one run per output_dir) for as long as it lives. RAM is not freed when a process dies, so every
run first removes the directories whose owner is gone: a killed run's weights are reclaimed by the
next one.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlparse

from asyncgrpo.generation.client import VLLMRequestError
from asyncgrpo.run.lock import OwnerLock, owner_gone
from asyncgrpo.weight_sync.filesystem import FilesystemWeightSync

logger = logging.getLogger(__name__)

# Linux's tmpfs for POSIX shared memory: RAM-backed wherever glibc runs, which is wherever vLLM's CPU
# backend runs.
SHARED_MEMORY_ROOT = Path("/dev/shm")
DIRECTORY_PREFIX = "asyncgrpo-weights-"
OWNER_LOCK = "owner.lock"
# RAM a run needs free, in copies of the served weights: two versions exist during a sync (the one
# the servers run and the one being written), and as much again stays free for the processes
# themselves, since tmpfs pages are never swapped to a file and never evicted.
ROOM_IN_MODEL_COPIES = 4


def servers_on_this_machine(urls: list[str]) -> bool:
    """Whether every server's host is this machine (a loopback address, or one this machine can
    bind): only then can a server read what the trainer writes to its RAM-backed storage."""
    return bool(urls) and all(_host_is_local(urlparse(url).hostname or "") for url in urls)


def _host_is_local(host: str) -> bool:
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        return False
    return bool(addresses) and all(_address_is_local(address) for address in addresses)


def _address_is_local(address: str) -> bool:
    if ipaddress.ip_address(address.split("%")[0]).is_loopback:
        return True
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 0))  # succeeds only for an address of one of this machine's interfaces
        except OSError:
            return False
    return True


def free_ram_bytes(root: Path = SHARED_MEMORY_ROOT) -> int:
    """What can still be written under `root`: the smaller of its own free space and the RAM
    the kernel says is available to new allocations (a tmpfs's size may exceed it)."""
    free = shutil.disk_usage(root).free
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return min(free, int(line.split()[1]) * 1024)
    except OSError:
        pass
    return free


def why_not_shared_memory(urls: list[str], model_bytes: int, root: Path = SHARED_MEMORY_ROOT) -> str | None:
    """None when the servers can be synced through `root`; otherwise why not, in words: a server on
    another machine, no writable `root`, or too little free RAM (ROOM_IN_MODEL_COPIES)."""
    if not servers_on_this_machine(urls):
        return f"a vLLM server is not on this machine ({', '.join(urls)})"
    if not (root.is_dir() and os.access(root, os.W_OK | os.X_OK)):
        return f"{root} is not a directory this process can write"
    free = free_ram_bytes(root)
    if free < ROOM_IN_MODEL_COPIES * model_bytes:
        return (
            f"{free / 2**30:.1f} GiB of RAM free under {root}, and a sync there needs "
            f"{ROOM_IN_MODEL_COPIES} x the {model_bytes / 2**30:.1f} GiB of served weights"
        )
    return None


def remove_orphans(root: Path = SHARED_MEMORY_ROOT) -> list[Path]:
    """Remove the directories of runs that are gone (they died without closing); returns them. A
    directory without a lock file is left alone: its owner is removing it, or is about to lock it."""
    removed = []
    for directory in root.glob(f"{DIRECTORY_PREFIX}*"):
        lock = directory / OWNER_LOCK
        try:
            if lock.exists() and owner_gone(lock):
                shutil.rmtree(directory, ignore_errors=True)
                removed.append(directory)
        except (NotADirectoryError, PermissionError):
            continue  # not ours to remove
    return removed


def owned_directory(root: Path = SHARED_MEMORY_ROOT) -> tuple[Path, OwnerLock]:
    """A fresh directory under `root`, locked by this process: (its path, its lock, to release when
    the directory is removed). Only this machine uses it: no heartbeat."""
    directory = Path(tempfile.mkdtemp(prefix=DIRECTORY_PREFIX, dir=root))
    lock = OwnerLock(directory, OWNER_LOCK, heartbeat_s=None)
    lock.acquire()
    return directory, lock


class SharedMemoryWeightSync(FilesystemWeightSync):
    name = "shared_memory"

    def __init__(
        self, client, loop, is_sender: bool = True, timeout_s: float | None = None, root: Path | None = None
    ):
        self.owned: Path | None = None
        self._lock = None
        directory = None
        if is_sender:
            root = root or SHARED_MEMORY_ROOT
            for orphan in remove_orphans(root):
                logger.info("weight sync: removed %s, left by a run that ended without cleaning up", orphan)
            self.owned, self._lock = owned_directory(root)
            directory = self.owned / "versions"
            logger.info("weight sync: safetensors in RAM under %s, reloaded by the servers", self.owned)
        super().__init__(client, loop, directory, is_sender=is_sender, timeout_s=timeout_s)

    def apply(self, prepared: Path, version: int, urls: list[str]) -> list[str]:
        try:
            return super().apply(prepared, version, urls)
        except VLLMRequestError as error:  # the server answered, and refused: say what to change
            raise VLLMRequestError(
                error.url,
                error.status,
                f"{error.server_message}. It could not reload the weights the trainer wrote to "
                f"{prepared}: a server must see this machine's shared memory, which one in a container "
                "without it (no --ipc=host) does not; set weight_sync_backend='filesystem' (a "
                "directory under output_dir, which the server must be able to read) for such servers",
            ) from error

    def close(self) -> None:
        super().close()
        if self.owned is None:
            return
        if self._reloading is None:
            shutil.rmtree(self.owned, ignore_errors=True)
            self._lock.release()
        else:  # a server may still be reading it: left for the next run to reclaim, as a dead run's
            self._lock.abandon()
        self.owned = None
