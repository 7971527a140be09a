"""The run directory callback: config.json, metrics.jsonl (one line per window), warnings.log of this
process and of a spawned one (the rollout worker's case)."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
from types import SimpleNamespace

from asyncgrpo.trainer.run_directory import WARNINGS_FILE_ENV, RunDirectoryCallback, attach_warnings_file


def _spawned_warning() -> None:
    attach_warnings_file()  # what the rollout worker does first
    logging.getLogger("asyncgrpo.rollout.loop").warning("from the worker")


def test_run_directory_files(tmp_path):
    args = SimpleNamespace(
        output_dir=str(tmp_path / "run"), to_json_string=lambda: json.dumps({"max_staleness": 2})
    )
    state = SimpleNamespace(is_world_process_zero=True, global_step=0)
    callback = RunDirectoryCallback()
    callback.on_init_end(args, state, None)
    try:
        assert os.environ[WARNINGS_FILE_ENV] == str((tmp_path / "run" / "warnings.log").resolve())
        logging.getLogger("asyncgrpo.trainer.intake").warning("from the trainer")
        process = multiprocessing.get_context("spawn").Process(target=_spawned_warning)
        process.start()
        process.join(60)
        assert process.exitcode == 0
        for step, reward in ((1, 0.5), (2, float("nan"))):
            state.global_step = step
            callback.on_log(args, state, None, logs={"reward": reward, "perf/step_s": 1.0})
    finally:
        callback.on_train_end(args, state, None)
    run = tmp_path / "run"
    assert json.loads((run / "config.json").read_text()) == {"max_staleness": 2}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward"], r["perf/step_s"]) for r in records] == [(1, 0.5, 1.0), (2, None, 1.0)]
    warnings = (run / "warnings.log").read_text()
    assert "from the trainer" in warnings and "from the worker" in warnings
    assert WARNINGS_FILE_ENV not in os.environ
    logging.getLogger("asyncgrpo.trainer.intake").warning("after the run")
    assert "after the run" not in (run / "warnings.log").read_text()
