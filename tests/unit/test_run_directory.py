"""The run directory callback: config.json, metrics.jsonl (one line per window), warnings.log of this
process and of a spawned one (the rollout worker's case)."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import sys
from types import SimpleNamespace

from asyncgrpo.run.files import WARNINGS_FILE_ENV, attach_warnings_file
from asyncgrpo.trainer.run_directory import RunDirectoryCallback


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


def _tensorboard_scalars(log_dir) -> dict[str, float]:
    """tag -> last value of the scalars in the event files under `log_dir` (TFRecord framing: length,
    its CRC, the Event proto, its CRC)."""
    import struct
    from pathlib import Path

    from tensorboardX.proto import event_pb2

    scalars = {}
    for path in Path(log_dir).rglob("events.out.tfevents.*"):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars[value.tag] = value.simple_value
    return scalars


def test_report_to_receives_the_logs_beside_the_run_directory(tiny_model_dir, tmp_path):
    """The run directory is one more callback: an integration named in report_to (tensorboard here)
    keeps its callback and gets the same window as metrics.jsonl."""
    from datasets import Dataset
    from transformers.integrations import TensorBoardCallback

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "run"),
        report_to=["tensorboard"],
        max_steps=1,
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "q"}]]})
    trainer = AsyncGRPOTrainer(str(tiny_model_dir), _zero_reward, args, train_dataset=dataset)
    try:
        kinds = {type(callback) for callback in trainer.callback_handler.callbacks}
        assert {TensorBoardCallback, RunDirectoryCallback} <= kinds
        (tensorboard,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, TensorBoardCallback)]
        tensorboard.on_train_begin(args, trainer.state, trainer.control)  # its writer, under output_dir
        trainer.state.global_step = 1
        trainer.log({"reward": 0.25, "rollout/queue_size": 3.0})
        tensorboard.tb_writer.flush()
    finally:
        trainer.callback_handler.on_train_end(args, trainer.state, trainer.control)
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert (record["step"], record["reward"], record["rollout/queue_size"]) == (1, 0.25, 3.0)
    scalars = _tensorboard_scalars(tmp_path / "run")
    assert scalars.get("train/reward") == 0.25 and scalars.get("train/rollout/queue_size") == 3.0, scalars


def _zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def test_log_completions_reaches_the_trackers_with_tables_and_never_stops_the_run(monkeypatch, caplog):
    """The completions go, as TRL's GRPO trainer sends them, to W&B (when a run is open) and trackio
    named in report_to, as a table under "completions"; a tracker that fails is warned about."""
    from recording_tracker import RecordingTracker

    from asyncgrpo.trainer.completions_table import log_to_trackers

    wandb, trackio = RecordingTracker("wandb"), RecordingTracker("trackio")
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "trackio", trackio)
    rows = [{"step": 2, "prompt": "p", "completion": "c", "reward": 1.0, "advantage": 0.5}]
    assert log_to_trackers(rows, ["tensorboard", "wandb", "trackio"]) == ["wandb", "trackio"]
    for tracker in (wandb, trackio):
        (logged,) = tracker.logged
        assert logged["completions"].dataframe.to_dict("records") == rows
    assert log_to_trackers(rows, ["tensorboard"]) == []
    wandb.run = None  # W&B without an open run: nothing to log into
    assert log_to_trackers(rows, ["wandb"]) == []

    def broken(values, step=None):
        raise RuntimeError("tracker offline")

    trackio.log = broken
    with caplog.at_level(logging.WARNING):
        assert log_to_trackers(rows, ["trackio"]) == []
    assert "did not reach trackio: tracker offline" in caplog.text
