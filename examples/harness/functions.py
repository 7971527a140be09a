"""The harness example's verify: the agent's answer, read from its working directory, against the
trainer's own copy of the dataset row."""

from __future__ import annotations

import re
from pathlib import Path


def answer_file_is_right(workdir: Path, transcript, row) -> float:
    """1 when the agent's answer.txt holds the row's `answer` and no other number, else 0.

    The answer comes from `row`, the trainer's copy of the dataset row: the agent never sees the
    `answer` column (only the columns `agent_columns` names reach its task.json), and nothing it
    writes in its working directory can change what this compares with. "No other number": an agent
    that writes every number it can think of is not right."""
    answer = workdir / "answer.txt"
    if not answer.is_file():
        return 0.0
    return float(re.findall(r"-?\d+", answer.read_text(errors="replace")) == [str(row["answer"])])
