"""The trainer's configuration: `AsyncGRPOConfig` (async_grpo_config.py), its fields declared by
concern in the modules of this package, and `AsyncDistillationConfig` (distillation.py) built on it."""

from asyncgrpo.config.async_grpo_config import AsyncGRPOConfig
from asyncgrpo.config.distillation import AsyncDistillationConfig
from asyncgrpo.config.pipeline import WEIGHT_SYNC_BACKENDS

__all__ = ["AsyncDistillationConfig", "AsyncGRPOConfig", "WEIGHT_SYNC_BACKENDS"]
