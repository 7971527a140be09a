"""A sandbox's folders from outside: how much disk they take, and removing them whatever their
writer did to them.

Bubblewrap has no disk quota, and a quota of the file system (ext4 project quotas, XFS) needs root.
So the folders a sandbox writes in are measured while it runs (`WATCH_INTERVAL_S`,
asyncgrpo/sandbox/limits.py) and a sandbox past `disk_bytes` is ended. Each entry counts at least
one block: a program that makes a million empty files is counted as it fills the file system's
table of files, not as empty.

The sandbox's files are the trainer user's own (the sandbox's user maps to it), so a folder its
writer made unreadable (mode 000) is made readable again: neither the measure nor the removal can be
hidden from. Links are never followed: a link to a folder outside is neither measured nor changed.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

BLOCK_BYTES = 4096


def _entries(folder: str) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except PermissionError:
        try:
            os.chmod(folder, 0o700)  # ours: the sandbox's writer took its permissions away
            with os.scandir(folder) as entries:
                return list(entries)
        except OSError:
            return []
    except OSError:  # removed meanwhile
        return []


def disk_usage(folders: Iterable[Path], stop_above: int) -> int:
    """The bytes the entries under `folders` take, counted until the total passes `stop_above` (a
    sandbox over its bound is not measured to the end)."""
    total = 0
    pending = [str(folder) for folder in folders]
    while pending:
        for entry in _entries(pending.pop()):
            try:
                stat = entry.stat(follow_symlinks=False)
            except OSError:  # removed meanwhile
                continue
            total += max(stat.st_blocks * 512, BLOCK_BYTES)
            if total > stop_above:
                return total
            if entry.is_dir(follow_symlinks=False):
                pending.append(entry.path)
    return total


def remove_tree(root: Path) -> None:
    """Remove `root` and everything under it, folders whose permissions were taken away included.
    Call it once nothing writes there any more (the sandbox has ended)."""
    pending = [str(root)]
    while pending:  # give every folder back its owner's permissions, top down, links left alone
        for entry in _entries(pending.pop()):
            if entry.is_dir(follow_symlinks=False):
                try:
                    os.chmod(entry.path, 0o700)
                except OSError:
                    pass
                pending.append(entry.path)
    shutil.rmtree(root, ignore_errors=True)
