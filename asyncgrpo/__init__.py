"""asyncgrpo: asynchronous GRPO post-training against a vLLM server (a drop-in for TRL's AsyncGRPO API).

The public names load on first use, so `import asyncgrpo.packing` (used on training-only machines)
does not pull in the HTTP client and the rollout worker.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "AsyncDistillationConfig": "asyncgrpo.config",
    "AsyncDistillationTrainer": "asyncgrpo.trainer.distillation_trainer",
    "AsyncGRPOConfig": "asyncgrpo.config",
    "AsyncGRPOTrainer": "asyncgrpo.trainer.async_grpo_trainer",
    "AsyncRolloutLoop": "asyncgrpo.rollout.loop",
    "HarnessAsyncGRPOTrainer": "asyncgrpo.trainer.harness_trainer",
    "Rollout": "asyncgrpo.rollout.types",
    "RolloutGroup": "asyncgrpo.rollout.types",
    "TrainingSequence": "asyncgrpo.rollout.types",
    "TurnRecord": "asyncgrpo.rollout.types",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from asyncgrpo.config import AsyncDistillationConfig, AsyncGRPOConfig
    from asyncgrpo.rollout.loop import AsyncRolloutLoop
    from asyncgrpo.rollout.types import Rollout, RolloutGroup, TrainingSequence, TurnRecord
    from asyncgrpo.trainer.async_grpo_trainer import AsyncGRPOTrainer
    from asyncgrpo.trainer.distillation_trainer import AsyncDistillationTrainer
    from asyncgrpo.trainer.harness_trainer import HarnessAsyncGRPOTrainer


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'asyncgrpo' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
