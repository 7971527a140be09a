"""The run directory: everything needed to read a run afterwards, under `output_dir`.

  config.json      the resolved AsyncGRPOConfig (every field, after defaults)
  metrics.jsonl    one JSON object per logging window: `step`, `time` and every metric logged
  warnings.log     warnings of the trainer and of the rollout worker process
  timeline.json    what each process did when (written by the trainer: asyncgrpo/timeline.py)
  checkpoint-N/    written by the base Trainer as usual

`asyncgrpo report RUN_DIR` reads this layout. It is written by a callback, beside `report_to`
(tensorboard, trackio, wandb keep receiving the same logs), so the training loop is unchanged.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from transformers import TrainerCallback

from asyncgrpo.redaction import redact_config
from asyncgrpo.run_files import (
    CONFIG_FILE,
    METRICS_FILE,
    WARNINGS_FILE,
    WARNINGS_FILE_ENV,
    attach_warnings_file,
    detach_warnings_file,
)


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
        self._directory.mkdir(parents=True, exist_ok=True)
        # Secrets (a hub token, a key inside a URL) redacted: the run directory is shared and kept.
        config = redact_config(json.loads(args.to_json_string()))
        (self._directory / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        warnings_path = self._directory / WARNINGS_FILE
        os.environ[WARNINGS_FILE_ENV] = str(warnings_path.resolve())
        attach_warnings_file(warnings_path)

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
