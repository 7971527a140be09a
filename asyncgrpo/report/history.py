"""A run's metrics history, read from its run directory (metrics.jsonl and config.json)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.run.files import CONFIG_FILE, METRICS_FILE


@dataclass
class History:
    """`records`: one dict per logging window, in step order, the last record of a step kept (a resumed
    run appends the steps it redoes). `config`: the run's resolved AsyncGRPOConfig fields."""

    records: list[dict] = field(default_factory=list)
    config: dict = field(default_factory=dict)

    @classmethod
    def from_records(cls, records: list[dict], config: dict | None = None) -> History:
        """An evaluation logs its own line at the step it measured, beside that step's window: the
        last window and the last evaluation of a step are merged into one record."""
        windows: dict[int, dict] = {}
        evaluations: dict[int, dict] = {}
        for record in records:
            if "step" in record and not _is_summary(record):
                kept = evaluations if _is_evaluation(record) else windows
                kept[int(record["step"])] = record
        steps = sorted(set(windows) | set(evaluations))
        merged = [{**evaluations.get(step, {}), **windows.get(step, {})} for step in steps]
        return cls(merged, dict(config or {}))

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

    def eval_prefixes(self, figure: str = "reward") -> list[str]:
        """The prefixes of the evaluations that logged `figure` (by default the headline, `reward`;
        a distillation run's is `teacher_kl`): `eval`, or `eval_{name}` per named eval dataset."""
        logged = re.compile(rf"eval(_[^/]+?)?_{re.escape(figure)}")
        names = {name for record in self.records for name in record if logged.fullmatch(name)}
        return sorted(name.removesuffix(f"_{figure}") for name in names)

    @property
    def steps(self) -> list[int]:
        return [int(record["step"]) for record in self.records]


def _is_evaluation(record: dict) -> bool:
    return any(name.startswith("eval_") for name in record)


def _is_summary(record: dict) -> bool:
    # The trainer's final log (train_runtime, train_loss) shares the last step; it is not a window.
    return "train_runtime" in record


def load_run(run_dir: str | Path) -> History:
    run_dir = Path(run_dir)
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.exists():
        if (run_dir / CONFIG_FILE).exists():  # a run that stopped (or crashed) before its first window
            raise FileNotFoundError(
                f"{run_dir} holds a run that logged no step yet (no {METRICS_FILE}): it stopped before its "
                "first logging window, or is still starting"
            )
        raise FileNotFoundError(
            f"{metrics_path} does not exist: give the output_dir of a run trained with asyncgrpo (it writes "
            f"{METRICS_FILE} there from the first logged step)"
        )
    lines = metrics_path.read_text(encoding="utf-8", errors="replace").splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = _record_of(line)
        except json.JSONDecodeError as error:
            if number == len(lines):
                break  # a run killed mid-write leaves a partial last line
            raise ConfigurationError(f"{metrics_path}:{number} is not JSON: {error}") from error
        if record is not None:
            records.append(record)
    config_path = run_dir / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
    except ValueError:  # emptied by a power loss before it was flushed: the metrics still read
        config = {}
    return History.from_records(records, config)


def _record_of(line: str) -> dict | None:
    """A line's record (None for a blank line, or zeros a power loss left). A crash can also leave a
    cut record, and runs that resumed without repairing the file first appended their first record to
    it on the same line: that record is kept, the cut one dropped. Anything else raises."""
    line = line.strip().strip("\0")
    if not line:
        return None
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        glued = line.rfind(_RECORD_START)
        if glued <= 0:
            raise
        return _record_of(line[glued:])


# Every record metrics.jsonl holds begins so (trainer/run_directory.py writes `step` first).
_RECORD_START = '{"step": '
