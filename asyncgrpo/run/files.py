"""The names of a run directory's files, and the warnings file every process of a run writes to.

Below the trainer, the rollout worker and the report alike: each of them reads or writes these files,
and none of them needs the others for it (docs/front-door.md describes the run directory).
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import logging.handlers
import os
import queue

from asyncgrpo.run.redaction import RedactingFormatter

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
WARNINGS_FILE = "warnings.log"
TIMELINE_FILE = "timeline.json"  # asyncgrpo/run/timeline.py writes it
# Held by the live run (asyncgrpo/run/lock.py): one run per directory.
RUN_LOCK_FILE = ".asyncgrpo-run.lock"
# The rollout worker is a spawned process: it learns where to write its warnings from this variable,
# which it inherits at spawn.
WARNINGS_FILE_ENV = "ASYNCGRPO_WARNINGS_FILE"

# warnings.log's bound: past this many bytes it becomes warnings.log.1 (replacing the one before) and
# a new warnings.log starts, so the two hold at most twice this, the most recent warnings, for a run
# of any length (a warning per failed rollout adds up over days).
WARNINGS_FILE_MAX_BYTES = 8 * 2**20

_FORMAT = "%(asctime)s %(processName)s %(name)s %(levelname)s: %(message)s"
_active: tuple[logging.Handler, logging.handlers.QueueListener | None] | None = None  # one file per process


class SharedRotatingFileHandler(logging.FileHandler):
    """A file several processes append to (the trainer and its rollout workers), rotated at
    `max_bytes` by whichever writer finds it full. Writers take turns under an flock on a file beside
    it, and one that finds its file rotated away by another reopens the path."""

    def __init__(self, path: str | os.PathLike, max_bytes: int | None = None):
        super().__init__(path, mode="a", encoding="utf-8")
        self.max_bytes = max_bytes or WARNINGS_FILE_MAX_BYTES
        folder, name = os.path.split(self.baseFilename)
        self._turns = open(os.path.join(folder, f".{name}.lock"), "a")  # noqa: SIM115 - closed in close()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = (self.format(record) + self.terminator).encode("utf-8")
            fcntl.flock(self._turns, fcntl.LOCK_EX)
            try:
                self._reopen_if_rotated()
                if os.fstat(self.stream.fileno()).st_size + len(line) > self.max_bytes:
                    self.stream.close()
                    os.replace(self.baseFilename, f"{self.baseFilename}.1")
                    self.stream = self._open()
                self.stream.write(line.decode("utf-8"))
                self.stream.flush()
            finally:
                fcntl.flock(self._turns, fcntl.LOCK_UN)
        except Exception:  # as any logging handler: a failed write must not fail the caller
            self.handleError(record)

    def _reopen_if_rotated(self) -> None:
        if self.stream is None:
            self.stream = self._open()
            return
        try:
            moved = os.stat(self.baseFilename).st_ino != os.fstat(self.stream.fileno()).st_ino
        except FileNotFoundError:
            moved = True
        if moved:
            self.stream.close()
            self.stream = self._open()

    def close(self) -> None:
        super().close()
        self._turns.close()


def attach_warnings_file(
    path: str | os.PathLike | None = None, background: bool = False
) -> logging.Handler | None:
    """Send the package's warnings to `path` (default: the file named by ASYNCGRPO_WARNINGS_FILE),
    instead of the file of an earlier run in this process; bounded (WARNINGS_FILE_MAX_BYTES).
    `background`: written by a thread of this process, so the thread that warns (the training loop)
    never waits for the disk. Returns the file handler, or None when no file is named."""
    global _active
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
    handler = SharedRotatingFileHandler(path)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(RedactingFormatter(_FORMAT))  # a warning quoting a key shows it redacted
    listener = None
    attached: logging.Handler = handler
    if background:
        records: queue.SimpleQueue = queue.SimpleQueue()
        attached = logging.handlers.QueueHandler(records)
        attached.setLevel(logging.WARNING)
        listener = logging.handlers.QueueListener(records, handler, respect_handler_level=True)
        listener.start()
    package_logger.addHandler(attached)
    _active = (attached, listener)
    return handler


def detach_warnings_file() -> None:
    """Stop writing the warnings file; what the background writer holds is written first."""
    global _active
    if _active is None:
        return
    attached, listener = _active
    _active = None
    logging.getLogger("asyncgrpo").removeHandler(attached)
    if listener is not None:
        listener.stop()  # writes what is queued, then ends its thread
        for handler in listener.handlers:
            handler.close()
    attached.close()


# A run that ends by an exception never reaches its callback's detach: the queued warnings are written
# at exit all the same (before logging's own shutdown, which runs after this).
atexit.register(detach_warnings_file)
