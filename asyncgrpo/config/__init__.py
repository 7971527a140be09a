"""The trainer's configuration: `AsyncGRPOConfig` (async_grpo_config.py), its fields declared by
concern in the modules of this package."""

from asyncgrpo.config.async_grpo_config import AsyncGRPOConfig
from asyncgrpo.config.pipeline import WEIGHT_SYNC_BACKENDS

__all__ = ["AsyncGRPOConfig", "WEIGHT_SYNC_BACKENDS"]
