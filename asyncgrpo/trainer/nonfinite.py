"""Non-finite training values: inf/NaN must never reach the weights or the vLLM servers.

A step whose loss or gradient norm is not finite is skipped (and so is its weight sync);
`MAX_NONFINITE_STEPS` skipped in a row stop the run; weights that are not finite are never sent to a
server (docs/reliability.md).
"""

from __future__ import annotations

import torch

# Steps in a row with a non-finite loss or gradient norm (each skipped) before the run stops.
MAX_NONFINITE_STEPS = 3


class NonFiniteTrainingError(RuntimeError):
    """Training produced inf/NaN values that must not reach the weights or the server."""


def weights_are_finite(model: torch.nn.Module) -> bool:
    """Whether every (local shard of every) parameter is finite: one device sync."""
    checks = [torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all() for p in model.parameters()]
    return bool(torch.stack(checks).all()) if checks else True
