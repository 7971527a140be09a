"""Files and directories that survive a crashed host, not only a killed process.

A rename is atomic, but after a power loss the renamed directory can hold empty files unless every
file and directory was flushed to the disk (fsync) before the rename, and the rename itself is
durable only once its parent directory is flushed. So what a run must find again (a checkpoint,
its rollout state and held samples) is written under a hidden staging name, flushed, renamed, and
the parent flushed, before anything older is removed (docs/reliability.md, "Durable checkpoints").

Staging names are `.NAME.partial`; a directory that a new copy replaces is first renamed
`.NAME.replaced`, so some complete copy of NAME exists at every moment. `remove_leftovers` runs when
a run starts and clears what a crash left of either.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

PARTIAL_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"


def staging_path(final: Path) -> Path:
    """Where `final` is written before it is renamed: a hidden name no checkpoint lookup matches."""
    return final.with_name(f".{final.name}{PARTIAL_SUFFIX}")


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file under `root`, then every directory from the deepest up to `root` itself."""
    directories = []
    for folder, _, files in os.walk(root):
        directories.append(Path(folder))
        for name in files:
            fsync_path(Path(folder) / name)
    for directory in reversed(directories):
        fsync_path(directory)


def write_atomically(path: Path, data: str | bytes) -> None:
    """`path` holds the old content or all of `data`, after a crash of the process or of the host."""
    path = Path(path)
    staging = staging_path(path)
    with open(staging, "wb") as file:
        file.write(data.encode("utf-8") if isinstance(data, str) else data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(staging, path)
    fsync_path(path.parent)


def publish_directory(staging: Path, final: Path) -> None:
    """Make the complete directory `staging` durable as `final`. An existing `final` is moved aside
    first and removed only once the new one is durable: if the host stops between the two renames,
    `remove_leftovers` puts it back."""
    fsync_tree(staging)
    replaced = None
    if final.exists():
        replaced = final.with_name(f".{final.name}{REPLACED_SUFFIX}")
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(staging, final)
    fsync_path(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def remove_leftovers(directory: Path) -> list[Path]:
    """What a crash left in `directory`: staging files and directories are removed (never complete
    for sure), and a moved-aside directory is put back where its new copy never arrived, removed
    otherwise. Returns the paths removed or restored."""
    touched = []
    for path in sorted(Path(directory).glob(".*")):
        name = path.name[1:]
        if name.endswith(PARTIAL_SUFFIX):
            _remove(path)
        elif name.endswith(REPLACED_SUFFIX):
            final = path.with_name(name.removesuffix(REPLACED_SUFFIX))
            if final.exists():
                _remove(path)
            else:
                os.replace(path, final)
        else:
            continue
        touched.append(path)
    if touched:
        fsync_path(Path(directory))
    return touched


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
