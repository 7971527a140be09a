"""What the rollout process sends the trainer through the rollout queue."""

from __future__ import annotations

from dataclasses import dataclass

from asyncgrpo.records.sample import Sample


@dataclass
class GroupResult:
    """The outcome of one prompt. `samples` is empty when the prompt was consumed without training
    (filtered out, or a group with no reward signal): the trainer still counts it for the epoch and
    for the resume position."""

    stream_index: int  # epoch * len(dataset) + place in that epoch's order
    epoch: int
    row_index: int
    group_id: int  # -1 for a prompt filter_prompt rejected
    samples: list[Sample]
    # The highest reward a rollout of the group scored; None when nothing was scored (filtered).
    # Lets the trainer tell a solved training set from one it cannot learn (trainer/intake.py).
    top_reward: float | None = None

    @property
    def num_tokens(self) -> int:
        return sum(sample.num_tokens for sample in self.samples)
