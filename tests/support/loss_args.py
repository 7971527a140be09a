"""The config a row's loss reads, as a plain object at AsyncGRPOConfig's resolved defaults: for tests that
call the trainer's `row_loss` directly, in processes that should not build TrainingArguments (a torchrun
worker, a GPU check)."""

from __future__ import annotations

from dataclasses import MISSING, fields
from types import SimpleNamespace

from asyncgrpo.config import AsyncGRPOConfig


def loss_args(**overrides) -> SimpleNamespace:
    """Every AsyncGRPOConfig field at its default (score centering on, epsilon_high = epsilon, as the
    config resolves them), then `overrides`."""
    values = {f.name: f.default for f in fields(AsyncGRPOConfig) if f.default is not MISSING}
    values.update(score_centering=True, epsilon_high=values["epsilon"])
    values.update(overrides)
    return SimpleNamespace(**values)
