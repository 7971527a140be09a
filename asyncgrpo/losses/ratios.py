"""The importance ratio a TRL loss carries, and how the off-policy correction composes with it.

The old policy of every formula is the sampler: log rho_t = log p_theta(y_t) - s_t, with s_t the
sampler's processed log-prob (docs/algorithm.md, "The loss types"). Entries are a packed row's (one per
(sample, trained token)); `entry_sample` says whose sequence each entry is, so a sequence's ratio never
mixes in another sample's tokens, even where two samples share a prefix in the trie.
"""

from __future__ import annotations

import torch

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.losses.off_policy import Correction, per_sequence_sum


def sequence_mean(values: torch.Tensor, entry_sample: torch.Tensor, num_samples: int) -> torch.Tensor:
    """(E,) each entry carries the mean of `values` over its sequence's entries (differentiable)."""
    counts = per_sequence_sum(torch.ones_like(values.detach()), entry_sample, num_samples).clamp(min=1.0)
    return (per_sequence_sum(values, entry_sample, num_samples) / counts)[entry_sample.long()]


def log_importance_weights(
    log_ratio: torch.Tensor, entry_sample: torch.Tensor, num_samples: int, level: str
) -> torch.Tensor:
    """(E,) log of the ratio the loss carries: the token's own ('token'), or its sequence's geometric
    mean, exp(mean_t log rho_t), broadcast to the sequence's entries ('sequence', GSPO)."""
    if level == "token":
        return log_ratio
    if level == "sequence":
        return sequence_mean(log_ratio, entry_sample, num_samples)
    raise ConfigurationError(f"importance_sampling_level={level!r} must be 'token' or 'sequence'")


def correction_factor(correction: Correction, loss_ratio: torch.Tensor) -> torch.Tensor:
    """(E,) what the correction multiplies each entry's policy term by, without gradient: TRL's
    `importance_sampling_ratio` with the sampler as the old policy.

    A masking mode keeps or drops the entry (1 or 0). A reweighting mode's weight w_t replaces the ratio
    the loss already carries (`loss_ratio`, the token's or the sequence's): the factor is w_t / r_t, so the
    term's gradient weight is w_t where the loss is linear in its ratio, as in TRL's synchronous trainer
    where the loss's own ratio is 1 and the correction carries the whole weight.
    """
    keep = correction.keep.to(loss_ratio.dtype)
    if correction.weight is None:
        return keep
    ratio = loss_ratio.detach()
    tiny = torch.finfo(ratio.dtype).tiny
    # A zero ratio has no gradient to reweight: its factor is 0, not w / 0.
    return torch.where(ratio > 0, correction.weight.to(ratio.dtype) / ratio.clamp(min=tiny), 0.0) * keep
