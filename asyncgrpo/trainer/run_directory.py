"""The run directory: everything needed to read a run afterwards, under `output_dir`.

  config.json      the resolved AsyncGRPOConfig (every field, after defaults)
  metrics.jsonl    one JSON object per logging window: `step`, `time` and every metric logged
  warnings.log     warnings of the trainer and of the rollout worker process (bounded: run_files.py)
  timeline.json    what each process did when (written by the trainer: asyncgrpo/run/timeline.py)
  checkpoint-N/    written by the base Trainer as usual
  .asyncgrpo-run.lock  held by the live run: one run per directory (asyncgrpo/run/lock.py)

`asyncgrpo report RUN_DIR` reads this layout. It is written by a callback, beside `report_to`
(tensorboard, trackio, wandb keep receiving the same logs), so the training loop is unchanged.
`hold_run_directory` takes the directory for a train() call and repairs what a crash left in it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

from transformers import TrainerCallback

from asyncgrpo.run.durable_files import remove_leftovers
from asyncgrpo.run.files import (
    CONFIG_FILE,
    METRICS_FILE,
    RUN_LOCK_FILE,
    WARNINGS_FILE,
    WARNINGS_FILE_ENV,
    attach_warnings_file,
    detach_warnings_file,
)
from asyncgrpo.run.lock import DirectoryInUseError, OwnerLock, owner_gone, read_owner
from asyncgrpo.run.redaction import redact_config

logger = logging.getLogger(__name__)

# What the refusal of a second run says to do.
_IN_USE_ADVICE = (
    "Two runs in one output_dir would delete each other's weight files and overwrite or rotate away "
    "each other's checkpoints: wait for that run to end, stop it, or give this run another output_dir."
)


def refuse_if_in_use(directory: str | os.PathLike) -> None:
    """DirectoryInUseError when a live run holds `directory` (before anything is written in it)."""
    lock = Path(directory) / RUN_LOCK_FILE
    if lock.exists() and not owner_gone(lock):
        owner = read_owner(lock)
        who = f" ({owner.describe()}; lock file {lock})" if owner else ""
        raise DirectoryInUseError(f"{directory} is in use by another live run{who}. {_IN_USE_ADVICE}")


def hold_run_directory(directory: str | os.PathLike) -> OwnerLock:
    """Take `directory` for one run (rank 0) and clear what a crash left in it: staging files and
    directories of an interrupted save, a checkpoint moved aside while it was replaced
    (asyncgrpo/run/durable_files.py), and a partial last line of metrics.jsonl, which the appends of this
    run would otherwise glue to their first record. Release the returned lock when the run ends."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lock = OwnerLock(directory, RUN_LOCK_FILE)
    lock.acquire(refusal=_IN_USE_ADVICE)
    try:
        for path in remove_leftovers(directory):
            logger.warning("%s: cleared %s, left by an interrupted run", directory, path.name)
        dropped = repair_jsonl(directory / METRICS_FILE)
        if dropped:
            logger.warning(
                "%s: dropped %d byte(s) of an unfinished last record, left by an interrupted run",
                directory / METRICS_FILE,
                dropped,
            )
    except BaseException:
        lock.release()
        raise
    return lock


def repair_jsonl(path: Path) -> int:
    """Cut the JSON-lines file at `path` after its last whole line: a write interrupted by a crash
    leaves a line without its newline at the end (after a power loss, also zeros). Returns the number
    of bytes dropped (0 for a sound file or none)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    end = len(data)
    while end > 0:
        start = data.rfind(b"\n", 0, end - 1) + 1  # the last line, its newline included when present
        line = data[start:end]
        if line.endswith(b"\n") and line.strip(b"\n\0 "):
            break
        end = start  # unfinished, blank, or zeros
    if end == len(data):
        return 0
    with open(path, "r+b") as file:
        file.truncate(end)
        file.flush()
        os.fsync(file.fileno())
    return len(data) - end


def _json_value(value):
    # NaN/inf are not JSON; null keeps the line readable by any JSON parser.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunDirectoryCallback(TrainerCallback):
    """Writes the run directory on the main process. Appends to metrics.jsonl, so a resumed run
    continues the same file (readers keep the last line of a step)."""

    def __init__(self):
        self._directory: Path | None = None

    def on_init_end(self, args, state, control, **kwargs):
        # Before train(): the rollout worker is spawned at the start of train() and must inherit the
        # warnings file.
        if not state.is_world_process_zero:
            return
        self._directory = Path(args.output_dir)
        refuse_if_in_use(self._directory)  # config.json below is the live run's
        self._directory.mkdir(parents=True, exist_ok=True)
        # Secrets (a hub token, a key inside a URL) redacted: the run directory is shared and kept.
        config = redact_config(json.loads(args.to_json_string()))
        (self._directory / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        warnings_path = self._directory / WARNINGS_FILE
        os.environ[WARNINGS_FILE_ENV] = str(warnings_path.resolve())
        attach_warnings_file(warnings_path, background=True)  # off the training thread

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._directory is None or not logs:
            return
        record = {"step": state.global_step, "time": time.time()}
        record.update({name: _json_value(value) for name, value in logs.items()})
        with open(self._directory / METRICS_FILE, "a", encoding="utf-8") as file:
            file.write(json.dumps(record) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        if self._directory is not None:
            detach_warnings_file()
            os.environ.pop(WARNINGS_FILE_ENV, None)
