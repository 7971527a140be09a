"""A run's metrics history, read from its run directory (metrics.jsonl and config.json)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from asyncgrpo.run_files import CONFIG_FILE, METRICS_FILE


@dataclass
class History:
    """`records`: one dict per logging window, in step order, the last record of a step kept (a resumed
    run appends the steps it redoes). `config`: the run's resolved AsyncGRPOConfig fields."""

    records: list[dict] = field(default_factory=list)
    config: dict = field(default_factory=dict)

    @classmethod
    def from_records(cls, records: list[dict], config: dict | None = None) -> History:
        by_step: dict[int, dict] = {}
        for record in records:
            if "step" in record and not _is_summary(record):
                by_step[int(record["step"])] = record
        return cls([by_step[step] for step in sorted(by_step)], dict(config or {}))

    def series(self, name: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the windows that logged `name` with a finite value."""
        steps, values = [], []
        for record in self.records:
            value = record.get(name)
            if isinstance(value, (int, float)) and math.isfinite(value):
                steps.append(int(record["step"]))
                values.append(float(value))
        return steps, values

    def has(self, name: str) -> bool:
        return bool(self.series(name)[0])

    @property
    def steps(self) -> list[int]:
        return [int(record["step"]) for record in self.records]


def _is_summary(record: dict) -> bool:
    # The trainer's final log (train_runtime, train_loss) shares the last step; it is not a window.
    return "train_runtime" in record


def load_run(run_dir: str | Path) -> History:
    run_dir = Path(run_dir)
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.exists():
        raise FileNotFoundError(
            f"{metrics_path} does not exist: give the output_dir of a run trained with asyncgrpo (it writes "
            f"{METRICS_FILE} there from the first logged step)"
        )
    lines = metrics_path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number == len(lines):
                break  # a run killed mid-write leaves a partial last line
            raise ValueError(f"{metrics_path}:{number} is not JSON: {error}") from error
    config_path = run_dir / CONFIG_FILE
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    return History.from_records(records, config)
