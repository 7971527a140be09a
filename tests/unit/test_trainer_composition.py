"""The trainer is composed, not stacked (docs/architecture.md, "The trainer's modules"): AsyncGRPOTrainer
has no base class of its own beside transformers' Trainer, and the run's state lives in the per-run
object. No cycle, no long function, no long module: tests/unit/test_architecture.py, package-wide."""

from __future__ import annotations

import ast
from pathlib import Path

TRAINER = Path(__file__).resolve().parents[2] / "asyncgrpo" / "trainer"


def test_the_trainer_stacks_no_mixin_and_its_run_state_lives_in_the_per_run_object():
    from transformers import Trainer

    from asyncgrpo.trainer.async_grpo_trainer import AsyncGRPOTrainer
    from asyncgrpo.trainer.training_run import TrainingRun

    assert AsyncGRPOTrainer.__bases__ == (Trainer,)
    fields = set(TrainingRun.__dataclass_fields__)
    assert {
        "processes",
        "ledger",
        "metrics",
        "session",
        "timeline",
        "served_step",
        "nonfinite_streak",
    } <= fields
    # The run's counters are assigned in the per-run object's module alone.
    for path in sorted(TRAINER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in ("served_step", "nonfinite_streak"):
                    where = f"{path.name}:{node.lineno}"
                    assert path.name == "training_run.py", where
