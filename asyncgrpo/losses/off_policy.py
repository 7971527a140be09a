"""Off-policy correction: which trained tokens the loss keeps, and the importance weight each carries.

The trainer's log-prob log p(y_t) and the sampler's s_t = log q(y_t) of every trained token give the
ratio rho_t = exp(log p - s_t). A mode (TRL's `vllm_importance_sampling_mode`, plus two) turns those
ratios into a keep mask and, for the reweighting modes, an importance weight; `off_policy_mask_threshold`
(DeepSeek-V3.2's off-policy sequence masking) may mask more. Sequence modes use a sequence's own
entries only: a packed row holds one loss entry per (sample, trained token), so a token shared by two
samples in the trie is two entries, one in each sequence (`entry_sample`). Pure tensor functions, no
gradient; docs/algorithm.md gives every formula.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from asyncgrpo.config.correction_modes import (  # noqa: F401 (the modes' names, read here too)
    ICEPOP,
    MODES,
    REWEIGHTING_MODES,
    SEQUENCE_GEOMETRIC_MASK,
    SEQUENCE_MASK,
    SEQUENCE_MODES,
    SEQUENCE_TRUNCATE,
    TOKEN_MASK,
    TOKEN_TRUNCATE,
    TRUNCATE_MODES,
)
from asyncgrpo.errors import ConfigurationError


@dataclass(frozen=True)
class CorrectionSettings:
    """The config's `vllm_importance_sampling_*` and `off_policy_mask_threshold` fields."""

    enabled: bool  # vllm_importance_sampling_correction
    mode: str  # one of MODES
    clip_min: float | None  # None: no lower bound
    clip_max: float | None  # None: no upper bound
    off_policy_mask_threshold: float | None  # None: no off-policy sequence masking

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigurationError(
                f"vllm_importance_sampling_mode={self.mode!r} is not a mode: pick one of {', '.join(MODES)}"
            )

    @property
    def low(self) -> float:
        return 0.0 if self.clip_min is None else float(self.clip_min)

    @property
    def high(self) -> float:
        return math.inf if self.clip_max is None else float(self.clip_max)


@dataclass
class Correction:
    """Per entry (E,), no gradient. `weight` is None for the masking-only modes (the loss keeps its
    own ratio); otherwise the importance weight the entry's gradient carries (0 where not kept)."""

    rho: torch.Tensor  # float: exp(log p - s), the token ratio
    keep: torch.Tensor  # bool
    weight: torch.Tensor | None
    masked_low: torch.Tensor  # bool: masked because the mode's ratio fell below clip_min
    masked_high: torch.Tensor  # bool: ... rose above clip_max
    masked_off_policy: torch.Tensor  # bool: masked by off_policy_mask_threshold
    truncated_low: torch.Tensor  # bool: weight raised to clip_min (truncate modes)
    truncated_high: torch.Tensor  # bool: weight lowered to clip_max


def per_sequence_sum(values: torch.Tensor, entry_sample: torch.Tensor, num_samples: int) -> torch.Tensor:
    """(num_samples,) sum of `values` (E,) over each sample's own entries."""
    out = torch.zeros(num_samples, dtype=values.dtype, device=values.device)
    return out.index_add_(0, entry_sample.long(), values)


# A k3 mismatch KL (nats per token) below which the sampler and the trainer agree to bf16 precision
# (a per-token log-prob gap of about 0.045); bf16 serving of an fp32 trainer measures well below it
# (bench/RESULTS.md, "Log-prob parity").
MISMATCH_KL_PRECISION_FLOOR = 1e-3


def mismatch_kl(logprobs: torch.Tensor, sampler_logprobs: torch.Tensor) -> torch.Tensor:
    """(E,) k3 estimate of KL(sampler || trainer) per token, from tokens the sampler drew:
    rho - 1 - log rho with rho = p / q. Never negative, 0 iff the two agree, unbiased in the mean."""
    log_rho = logprobs.detach() - sampler_logprobs
    return torch.expm1(log_rho) - log_rho


def correct(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    entry_sample: torch.Tensor,
    num_samples: int,
    settings: CorrectionSettings,
) -> Correction:
    """The keep mask and weights of a row's (or micro-batch's) entries under `settings`."""
    log_rho = logprobs.detach().to(torch.float64) - sampler_logprobs.to(torch.float64)
    rho = log_rho.exp()
    none = torch.zeros_like(rho, dtype=torch.bool)
    if not settings.enabled:
        return Correction(rho.to(logprobs.dtype), ~none, None, none, none, none, none, none)
    mode, low, high = settings.mode, settings.low, settings.high
    if mode in SEQUENCE_MODES:
        counts = per_sequence_sum(torch.ones_like(log_rho), entry_sample, num_samples).clamp(min=1.0)
        log_seq = per_sequence_sum(log_rho, entry_sample, num_samples)
        if mode == SEQUENCE_GEOMETRIC_MASK:
            log_seq = log_seq / counts  # the geometric mean of the sequence's token ratios
        ratio = log_seq.exp()[entry_sample.long()]  # each entry carries its sequence's ratio
    else:
        ratio = rho
    below, above = ratio < low, ratio > high
    if mode in TRUNCATE_MODES:
        keep, weight = ~none, ratio.clamp(min=low, max=high)
        masked_low, masked_high, truncated_low, truncated_high = none, none, below, above
    else:
        keep = ~(below | above)
        weight = torch.where(keep, ratio, torch.zeros_like(ratio)) if mode in REWEIGHTING_MODES else None
        masked_low, masked_high, truncated_low, truncated_high = below, above, none, none
    masked_off_policy = none
    if settings.off_policy_mask_threshold is not None:
        masked_off_policy = off_policy_sequence_mask(
            logprobs,
            sampler_logprobs,
            advantages,
            entry_sample,
            num_samples,
            settings.off_policy_mask_threshold,
        )
        keep = keep & ~masked_off_policy
        if weight is not None:
            weight = torch.where(keep, weight, torch.zeros_like(weight))
    dtype = logprobs.dtype
    return Correction(
        rho.to(dtype),
        keep,
        None if weight is None else weight.to(dtype),
        masked_low,
        masked_high,
        masked_off_policy,
        truncated_low,
        truncated_high,
    )


def off_policy_sequence_mask(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    entry_sample: torch.Tensor,
    num_samples: int,
    threshold: float,
) -> torch.Tensor:
    """(E,) bool, True where masked: the entry's sequence has a negative advantage and its mean
    per-token log q - log p (a KL(sampler || trainer) estimate) exceeds `threshold`. A sequence the
    policy has moved away from, pushed down further, is where a negative update does harm."""
    diff = sampler_logprobs.to(torch.float64) - logprobs.detach().to(torch.float64)
    counts = per_sequence_sum(torch.ones_like(diff), entry_sample, num_samples).clamp(min=1.0)
    mean_kl = (per_sequence_sum(diff, entry_sample, num_samples) / counts)[entry_sample.long()]
    return (advantages.detach() < 0) & (mean_kl > threshold)
