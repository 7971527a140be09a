"""asyncgrpo: asynchronous GRPO post-training against a vLLM server (a drop-in for TRL's AsyncGRPO API)."""

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.types import Rollout, RolloutGroup, TrainingSequence, TurnRecord
from asyncgrpo.trainer.async_grpo_trainer import AsyncGRPOTrainer

__all__ = [
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "AsyncRolloutLoop",
    "Rollout",
    "RolloutGroup",
    "TrainingSequence",
    "TurnRecord",
]
