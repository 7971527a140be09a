"""Non-finite training values: inf/NaN must never reach the weights or the vLLM servers.

A step whose loss or gradient norm is not finite is skipped (and so is its weight sync);
`MAX_NONFINITE_STEPS` skipped in a row stop the run; weights that are not finite are never sent to a
server (docs/reliability.md).
"""

from __future__ import annotations

import torch

from asyncgrpo.errors import TrainingError

# Steps in a row with a non-finite loss or gradient norm (each skipped) before the run stops.
MAX_NONFINITE_STEPS = 3


class NonFiniteTrainingError(TrainingError):
    """Training produced inf/NaN values that must not reach the weights or the server."""


def weights_are_finite(model: torch.nn.Module) -> bool:
    """Whether every (local shard of every) parameter is finite: one device sync. One fused call
    takes every tensor's norm in float32 (an inf or NaN makes its norm so), rather than two
    operations per parameter, whose launches cost more than the check itself and made it the
    largest part of a weight sync (bench/RESULTS.md, "timeline"). A finite weight beyond about 1e19
    overflows its norm and counts as not finite: training has failed long before that."""
    local = [(p.to_local() if hasattr(p, "to_local") else p).detach() for p in model.parameters()]
    if not local:
        return True
    norms = torch._foreach_norm(local, 2.0, dtype=torch.float32)
    return bool(torch.isfinite(torch.stack(norms)).all())
