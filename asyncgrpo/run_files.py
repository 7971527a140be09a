"""The names of a run directory's files, and the warnings file every process of a run writes to.

Below the trainer, the rollout worker and the report alike: each of them reads or writes these files,
and none of them needs the others for it (docs/front-door.md describes the run directory).
"""

from __future__ import annotations

import logging
import os

from asyncgrpo.redaction import RedactingFormatter

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
WARNINGS_FILE = "warnings.log"
TIMELINE_FILE = "timeline.json"  # asyncgrpo/timeline.py writes it
# The rollout worker is a spawned process: it learns where to write its warnings from this variable,
# which it inherits at spawn.
WARNINGS_FILE_ENV = "ASYNCGRPO_WARNINGS_FILE"

_FORMAT = "%(asctime)s %(processName)s %(name)s %(levelname)s: %(message)s"
_active_handler: logging.Handler | None = None  # one run directory at a time per process


def attach_warnings_file(path: str | os.PathLike | None = None) -> logging.Handler | None:
    """Send the package's warnings to `path` (default: the file named by ASYNCGRPO_WARNINGS_FILE),
    instead of the file of an earlier run in this process. Returns the handler, or None when no file
    is named."""
    global _active_handler
    path = path or os.environ.get(WARNINGS_FILE_ENV)
    if not path:
        return None
    package_logger = logging.getLogger("asyncgrpo")
    detach_warnings_file()
    if not package_logger.hasHandlers():
        # Without any handler Python prints warnings to stderr (its last resort); adding the file
        # would silence that, so stderr gets an explicit handler first.
        console = logging.StreamHandler()
        console.setLevel(logging.WARNING)
        package_logger.addHandler(console)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logging.WARNING)
    handler.setFormatter(RedactingFormatter(_FORMAT))  # a warning quoting a key shows it redacted
    package_logger.addHandler(handler)
    _active_handler = handler
    return handler


def detach_warnings_file() -> None:
    global _active_handler
    if _active_handler is not None:
        logging.getLogger("asyncgrpo").removeHandler(_active_handler)
        _active_handler.close()
        _active_handler = None
