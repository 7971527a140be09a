"""A row's whole loss: the policy term of the configured loss, the KL to the reference and the entropy
bonus, with TRL's metric names.

`loss_type=None` runs asyncgrpo's own losses (asyncgrpo/losses/policy_loss.py) unchanged; a named loss type
runs TRL 1.16's formula with the sampler as the old policy, composed with the off-policy correction as TRL
composes its vLLM importance-sampling ratio (losses/ratios.py). The KL and the entropy bonus are added the
same way whichever policy term runs. docs/algorithm.md states every formula.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncgrpo.config.algorithm import CLIPPED_LOSS_TYPES, LOSS_TYPES
from asyncgrpo.errors import ConfigurationError
from asyncgrpo.losses.aggregation import LossTotals, aggregate
from asyncgrpo.losses.off_policy import Correction, CorrectionSettings, correct, per_sequence_sum
from asyncgrpo.losses.policy_loss import (
    LossInputs,
    clip_ratio_metrics,
    clipped_surrogate_loss,
    sampling_metrics,
    score_centered_loss,
)
from asyncgrpo.losses.policy_terms import cispo_term, clipped_term, sapo_term, vespo_term, vespo_weights
from asyncgrpo.losses.ratios import correction_factor, log_importance_weights, sequence_mean
from asyncgrpo.losses.regularizers import entropy_bonus, reference_kl
from asyncgrpo.records.metrics import Reduce, Stat


@dataclass(frozen=True)
class AlgorithmSettings:
    """What a row's loss needs from the config (and, for the entropy bonus, the coefficient this step
    applies)."""

    loss_type: str | None
    score_centering: bool
    correction: CorrectionSettings
    epsilon: float
    epsilon_high: float
    importance_sampling_level: str = "token"
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_parameters: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)  # k+, lambda+, k-, lambda-
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    entropy_bonus: bool = False  # whether the bonus is in the loss (adaptive: always)
    entropy_coef: float = 0.0  # the coefficient this step applies

    def __post_init__(self):
        if self.loss_type is not None and self.loss_type not in LOSS_TYPES:
            raise ConfigurationError(
                f"loss_type={self.loss_type!r} is not a loss: pick one of {', '.join(LOSS_TYPES)}"
            )


def algorithm_loss(
    x: LossInputs, settings: AlgorithmSettings, totals: LossTotals
) -> tuple[torch.Tensor, dict[str, Stat]]:
    """The row's share of the step's loss, and its metrics (docs/metrics.md)."""
    num_samples = x.sample_count() if len(x.logprobs) else 0
    if settings.loss_type is None:
        loss, metrics, ratio, keep = _own_policy_loss(x, settings, totals, num_samples)
    else:
        loss, metrics, ratio, keep = _trl_policy_loss(x, settings, totals, num_samples)
    if settings.beta != 0.0:
        if x.ref_logprobs is None:
            raise ValueError(
                "beta != 0 needs the reference's log-probs of every trained token (ref_logprobs)"
            )
        kl = reference_kl(x.logprobs, x.ref_logprobs)
        if settings.use_bias_correction_kl:
            kl = kl * ratio  # the loss's own ratio, with its gradient (DeepSeek-V3.2's correction)
        # A token the correction removes leaves the whole loss, its KL included.
        kl = torch.where(keep, kl, torch.zeros_like(kl))
        loss = loss + aggregate(settings.beta * kl, x.entry_sample, num_samples, settings.loss_type, totals)
        if len(kl):
            metrics["kl"] = Stat(Reduce.MEAN, kl.detach().sum(), float(len(kl)))
    if settings.entropy_bonus:
        # The row's share of the step's total, weight 0: the trainer adds the step's weight, once per
        # step (LossMenu.after_step), so a window logs the mean over its steps of each step's sum.
        metrics["policy_loss"] = Stat(Reduce.MEAN, loss.detach(), 0.0)
        loss = loss - entropy_bonus(x.entropy, x.policy_mask, settings.entropy_coef, totals.step_rows)
        effective = torch.ones_like(x.entropy) if x.policy_mask is None else x.policy_mask.to(x.entropy.dtype)
        if len(effective):
            metrics["entropy/bonus_tokens_mean"] = Stat(
                Reduce.MEAN, (x.entropy.detach() * effective).sum(), effective.sum()
            )
    return loss, metrics


def _own_policy_loss(x: LossInputs, s: AlgorithmSettings, totals: LossTotals, num_samples: int):
    """asyncgrpo's own score-centered or clipped loss (asyncgrpo/losses/policy_loss.py), as it always ran; the
    token ratio and keep mask for the KL term."""
    policy = score_centered_loss if s.score_centering else clipped_surrogate_loss
    loss, metrics = policy(
        x,
        correction=s.correction,
        epsilon=s.epsilon,
        epsilon_high=s.epsilon_high,
        num_trained_tokens_global=totals.microbatch_trained_tokens,
        gradient_accumulation_steps=totals.gradient_accumulation_steps,
    )
    ratio = keep = None
    if s.beta != 0.0:
        keep = _correction(x, s.correction, num_samples).keep
        ratio = torch.exp(x.logprobs - x.sampler_logprobs)
    return loss, metrics, ratio, keep


def _correction(x: LossInputs, settings: CorrectionSettings, num_samples: int) -> Correction:
    return correct(x.logprobs, x.sampler_logprobs, x.advantages, x.entry_sample, num_samples, settings)


def _trl_policy_loss(x: LossInputs, s: AlgorithmSettings, totals: LossTotals, num_samples: int):
    """TRL 1.16's `_compute_loss` policy term for `s.loss_type`, old policy = the sampler: (the row's
    share, metrics, the loss's ratio with gradient, the correction's keep mask)."""
    c = _correction(x, s.correction, num_samples)
    log_ratio = x.logprobs - x.sampler_logprobs
    coef = torch.exp(
        log_importance_weights(log_ratio, x.entry_sample, num_samples, s.importance_sampling_level)
    )
    factor = correction_factor(c, coef)
    advantages, loss_type, phi = x.advantages, s.loss_type, None
    if loss_type == "vespo":
        phi = vespo_weights(log_ratio, advantages, x.entry_sample, num_samples, factor, *s.vespo_parameters)
        per_token = vespo_term(phi, advantages, x.logprobs)
        # The correction's weights are folded into phi; only the off-policy sequence mask multiplies.
        kept, scale = ~c.masked_off_policy, None
    else:
        if loss_type == "cispo":
            per_token = cispo_term(coef, advantages, x.logprobs, s.epsilon_high)
        elif loss_type == "sapo":
            per_token = sapo_term(coef, advantages, s.sapo_temperature_pos, s.sapo_temperature_neg)
        else:
            per_token = clipped_term(coef, advantages, s.epsilon, s.epsilon_high, s.delta)
        kept, scale = factor > 0, factor
    if x.policy_mask is not None:
        kept = kept & x.policy_mask
    if scale is not None:
        per_token = per_token * scale
    # where, not multiply: a dropped entry's term may be inf (log p = -inf), and 0 * inf is NaN.
    per_token = torch.where(kept, per_token, torch.zeros_like(per_token))
    loss = aggregate(per_token, x.entry_sample, num_samples, loss_type, totals)
    metrics = sampling_metrics(x, c)
    if metrics:
        metrics.update(_loss_type_metrics(x, s, coef, phi))
    return loss, metrics, coef, c.keep


def _loss_type_metrics(
    x: LossInputs, s: AlgorithmSettings, coef: torch.Tensor, phi: torch.Tensor | None
) -> dict[str, Stat]:
    """TRL's metrics of each loss type: clip_ratio/* (clipped types), cispo_clip_ratio, vespo/phi_seq_mean;
    over tokens, or over sequences with sequence-level ratios."""
    per_sequence = s.importance_sampling_level == "sequence"
    if s.loss_type in CLIPPED_LOSS_TYPES:
        return clip_ratio_metrics(x, coef, s.epsilon, s.epsilon_high, per_sequence)
    if s.loss_type == "cispo":
        clipped = ((coef.detach() > s.epsilon_high) & (x.advantages > 0)).to(coef.dtype)
        return {"cispo_clip_ratio": Stat(Reduce.MEAN, *_sum_and_count(x, clipped, per_sequence))}
    if s.loss_type == "vespo":
        return {"vespo/phi_seq_mean": Stat(Reduce.MEAN, *_sum_and_count(x, phi, per_sequence=True))}
    return {}


def _sum_and_count(
    x: LossInputs, values: torch.Tensor, per_sequence: bool
) -> tuple[torch.Tensor, torch.Tensor | float]:
    """(sum, count) of (E,) `values` over entries, or over sequences when each sequence's entries share
    one value (each sequence once: every entry weighs 1 / its sequence's entries). On the values'
    device or a float: the step's row values are read back in one transfer (trainer/row_loss.py)."""
    values = values.detach()
    if not per_sequence:
        return values.sum(), float(len(values))
    num_samples = x.sample_count()
    counts = per_sequence_sum(torch.ones_like(values), x.entry_sample, num_samples)
    per_entry = sequence_mean(values, x.entry_sample, num_samples)
    return (per_entry / counts[x.entry_sample.long()]).sum(), (counts > 0).sum().float()
