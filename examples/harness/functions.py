"""The harness example's verify: the reward is read from the agent's working directory."""

from __future__ import annotations

import json
from pathlib import Path


def answer_in_files(workdir: Path, transcript) -> float:
    """1 when a file the agent wrote holds the row's `answer` (task.json has the row), else 0."""
    answer = str(json.loads((workdir / "task.json").read_text())["answer"])
    written = [path for path in workdir.iterdir() if path.name != "task.json" and path.is_file()]
    return float(any(answer in path.read_text(errors="replace") for path in written))
