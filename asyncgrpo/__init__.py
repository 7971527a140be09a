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
    "AsyncGRPOError": "asyncgrpo.errors",
    "AsyncGRPOTrainer": "asyncgrpo.trainer.async_grpo_trainer",
    "AsyncRolloutLoop": "asyncgrpo.rollout.loop",
    "CheckpointError": "asyncgrpo.errors",
    "ConfigurationError": "asyncgrpo.errors",
    "HarnessError": "asyncgrpo.errors",
    "HarnessAsyncGRPOTrainer": "asyncgrpo.trainer.harness_trainer",
    "RewardError": "asyncgrpo.errors",
    "Rollout": "asyncgrpo.rollout.types",
    "RolloutError": "asyncgrpo.errors",
    "RolloutGroup": "asyncgrpo.rollout.types",
    "SandboxError": "asyncgrpo.errors",
    "ServerError": "asyncgrpo.errors",
    "ServerLostError": "asyncgrpo.generation.errors",
    "TrainingError": "asyncgrpo.errors",
    "TrainingSequence": "asyncgrpo.rollout.types",
    "TurnRecord": "asyncgrpo.rollout.types",
    "WeightSyncError": "asyncgrpo.errors",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from asyncgrpo.config import AsyncDistillationConfig, AsyncGRPOConfig
    from asyncgrpo.errors import (
        AsyncGRPOError,
        CheckpointError,
        ConfigurationError,
        HarnessError,
        RewardError,
        RolloutError,
        SandboxError,
        ServerError,
        TrainingError,
        WeightSyncError,
    )
    from asyncgrpo.generation.errors import ServerLostError
    from asyncgrpo.rollout.loop import AsyncRolloutLoop
    from asyncgrpo.rollout.types import Rollout, RolloutGroup, TrainingSequence, TurnRecord
    from asyncgrpo.trainer.async_grpo_trainer import AsyncGRPOTrainer
    from asyncgrpo.trainer.distillation_trainer import AsyncDistillationTrainer
    from asyncgrpo.trainer.harness_trainer import HarnessAsyncGRPOTrainer


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'asyncgrpo' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
