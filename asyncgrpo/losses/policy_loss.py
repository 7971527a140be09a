"""The policy losses: pure tensor functions returning `(loss, metrics)`.

Both losses correct for the sampler being off-policy (vLLM's processed log-probs, a stale or differently
computed policy) with the mode of `asyncgrpo.losses.off_policy` (masking by default, or importance weights),
and divide the micro-batch's sum by its trained tokens counted over all processes (masked ones included,
known from the plan) and by `gradient_accumulation_steps`. DDP and FSDP average gradients, so the
caller multiplies the loss by the world size before backward: this module never sees
torch.distributed. `epsilon_high` has one default, in AsyncGRPOConfig. docs/algorithm.md derives the
formulas. Metrics are `Stat`s whose merge across micro-batches and processes is exact (means carry
their (sum, count)); values are detached 0-d tensors, converted by whoever logs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.losses.off_policy import Correction, CorrectionSettings, correct, mismatch_kl, per_sequence_sum
from asyncgrpo.records.metrics import Reduce, Stat

# Floor of the trainer's tail mass 1 - P_H in alpha = (1 - Q_H) / (1 - P_H). In float32 P_H can
# round to 1 (or above); and a huge alpha is numerically poor: the gradient is then the difference
# of two terms of size ~alpha (the centering coefficients q_v - alpha * p_v and the softmax
# normalization), so alpha is kept <= 1e5 (error ~ alpha * 6e-8 in float32). Below the floor the
# sampler's leftover tail mass is spread over H in proportion to p instead of over the tail.
_MIN_TAIL_MASS = 1e-5


@dataclass
class LossInputs:
    """Per trained entry (E of them) of a micro-batch; float tensors (fp32 or wider, as from
    `token_logprobs`); only the trainer's log-probs carry gradient."""

    logprobs: torch.Tensor  # (E,) trainer log p(y_t) (after temperature / candidate set)
    sampler_logprobs: torch.Tensor  # (E,) sampler log-prob of y_t
    advantages: torch.Tensor  # (E,)
    entry_sample: torch.Tensor  # (E,) int: the entry's sample, for the per-sample clip metrics
    entropy: torch.Tensor | None = None  # (E,) trainer entropy, for the metric
    top_logprobs: torch.Tensor | None = None  # (E, N) trainer log p_v at the sampler's top-N ids, -inf padded
    sampler_top_logprobs: torch.Tensor | None = None  # (E, N) sampler's top-N log-probs, -inf padded
    # More than the largest entry_sample, known on the host: the per-sample metrics then need no
    # device-to-host read (a GPU sync mid-step). None: read from entry_sample.
    num_samples: int | None = None
    ref_logprobs: torch.Tensor | None = None  # (E,) reference log p_ref(y_t), no gradient (beta > 0)
    policy_mask: torch.Tensor | None = None  # (E,) bool: tokens the policy term keeps (top_entropy_quantile)

    def sample_count(self) -> int:
        return self.num_samples if self.num_samples is not None else int(self.entry_sample.max()) + 1


def _correction(x: LossInputs, settings: CorrectionSettings) -> Correction:
    num_samples = x.sample_count() if len(x.logprobs) else 0
    return correct(x.logprobs, x.sampler_logprobs, x.advantages, x.entry_sample, num_samples, settings)


def _kept(x: LossInputs, c: Correction) -> torch.Tensor:
    """The correction's keep mask, and the policy mask (high-entropy tokens) when there is one."""
    return c.keep if x.policy_mask is None else c.keep & x.policy_mask


def centering_coefficients(top_logprobs: torch.Tensor, sampler_top_logprobs: torch.Tensor) -> torch.Tensor:
    """(E, N) sg(q_v - alpha * p_v) with alpha = (1 - Q_H) / (1 - P_H), no gradient.

    q_v: the sampler's full-vocabulary probabilities of its top-N (not renormalized), p_v the
    trainer's. The sampler's tail is assumed proportional to p, so the centering distribution is
    qhat = q on H and alpha * p outside it; Q_H > 1 from rounding gives alpha = 0.
    """
    q = sampler_top_logprobs.detach().exp()  # (E, N), 0 where padded
    p = top_logprobs.detach().exp()
    tail_q = (1.0 - q.sum(-1)).clamp(min=0.0)
    tail_p = (1.0 - p.sum(-1)).clamp(min=_MIN_TAIL_MASS)
    alpha = tail_q / tail_p  # (E,)
    return q - alpha[:, None] * p


def score_centered_loss(
    x: LossInputs,
    *,
    correction: CorrectionSettings,
    epsilon: float,
    epsilon_high: float,
    num_trained_tokens_global: float,
    gradient_accumulation_steps: int,
) -> tuple[torch.Tensor, dict[str, Stat]]:
    """Score centering (the default): per entry
    `loss_t = -m_t * A_t * [log p(y_t) - sum_{v in H} sg(q_v - alpha * p_v) * log p_v]`,
    whose gradient w.r.t. the logits z is `-m_t * A_t * (e_y - qhat) / temperature`: the score of
    y minus its expectation under the sampler, so a constant advantage does not pull the policy
    toward the sampler. Unlike the clipped surrogate it carries no ratio and no clipping; epsilon
    and epsilon_high only define the clip_ratio/* metrics (tokens outside the trust region). m_t is
    the correction's keep mask; a reweighting mode also multiplies the term by its weight w_t.
    """
    if x.top_logprobs is None or x.sampler_top_logprobs is None:
        raise ConfigurationError(
            "score centering needs the sampler's top-N log-probs of every trained token: set "
            "num_sampler_logprobs > 0, or score_centering=False"
        )
    if x.top_logprobs.shape != x.sampler_top_logprobs.shape:
        raise ValueError(
            f"trainer top log-probs {tuple(x.top_logprobs.shape)} and sampler top log-probs "
            f"{tuple(x.sampler_top_logprobs.shape)} must be gathered at the same ids"
        )
    c = _correction(x, correction)
    coefficients = centering_coefficients(x.top_logprobs, x.sampler_top_logprobs)  # (E, N)
    # Padded ids (and ids outside the candidate set) have log p = -inf and coefficient 0.
    valid = x.top_logprobs > float("-inf")
    centering = (coefficients * x.top_logprobs.masked_fill(~valid, 0.0)).sum(-1)
    per_token = -x.advantages * (x.logprobs - centering)
    loss = _normalize(
        per_token, _kept(x, c), c.weight, num_trained_tokens_global, gradient_accumulation_steps
    )

    metrics = _shared_metrics(x, c, epsilon, epsilon_high)
    if len(c.rho):
        sampler_mass = x.sampler_top_logprobs.detach().exp().sum(-1)  # Q_H (E,)
        metrics["sampling/sampler_mass"] = Stat(Reduce.MEAN, sampler_mass.sum(), float(len(c.rho)))
    return loss, metrics


def clipped_surrogate_loss(
    x: LossInputs,
    *,
    correction: CorrectionSettings,
    epsilon: float,
    epsilon_high: float,
    num_trained_tokens_global: float,
    gradient_accumulation_steps: int,
) -> tuple[torch.Tensor, dict[str, Stat]]:
    """GRPO's clipped surrogate with the sampler as the old policy (score_centering=False): per entry
    `loss_t = -m_t * min(rho_t * A_t, clip(rho_t, 1 - epsilon, 1 + epsilon_high) * A_t)`. rho_t is
    already the whole importance ratio; a reweighting mode swaps it for its weight w_t inside the
    trust region by the factor sg(w_t / rho_t), so the gradient there is w_t * A_t * grad log p."""
    c = _correction(x, correction)
    # Recomputed with gradient: exp of -inf (a target outside the candidate set) is a finite 0.
    rho = torch.exp(x.logprobs - x.sampler_logprobs)
    advantages = x.advantages
    clipped = torch.clamp(rho, 1.0 - epsilon, 1.0 + epsilon_high)
    per_token = -torch.minimum(rho * advantages, clipped * advantages)
    factor = None
    if c.weight is not None:  # a zero ratio has no gradient to reweight: its factor is 0, not w / 0
        factor = torch.where(c.rho > 0, c.weight / c.rho.clamp(min=torch.finfo(c.rho.dtype).tiny), 0.0)
    loss = _normalize(per_token, _kept(x, c), factor, num_trained_tokens_global, gradient_accumulation_steps)
    return loss, _shared_metrics(x, c, epsilon, epsilon_high)


def _normalize(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    factor: torch.Tensor | None,
    num_trained_tokens_global: float,
    gradient_accumulation_steps: int,
) -> torch.Tensor:
    """sum_t m_t * f_t * loss_t / num_trained_tokens_global / gradient_accumulation_steps (f_t = 1
    when `factor` is None)."""
    if not num_trained_tokens_global > 0:
        raise ValueError(
            f"num_trained_tokens_global must be > 0 (the micro-batch's trained tokens summed over all "
            f"processes), got {num_trained_tokens_global}"
        )
    if gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
    # where, not multiply: a masked token's term may be inf (log p = -inf) and 0 * inf is NaN.
    if factor is not None:
        per_token = per_token * factor.detach()
    kept = torch.where(mask, per_token, torch.zeros_like(per_token))
    return kept.sum() / (float(num_trained_tokens_global) * gradient_accumulation_steps)


def _shared_metrics(x: LossInputs, c: Correction, epsilon: float, epsilon_high: float) -> dict[str, Stat]:
    """The sampling/*, entropy and clip_ratio/* metrics, over the trained tokens (masked or not)."""
    metrics = sampling_metrics(x, c)
    if metrics:
        metrics.update(clip_ratio_metrics(x, c.rho, epsilon, epsilon_high))
    return metrics


def clip_ratio_metrics(
    x: LossInputs, ratio: torch.Tensor, epsilon: float, epsilon_high: float, per_sequence: bool = False
) -> dict[str, Stat]:
    """TRL's clip_ratio/*: the share of entries (`per_sequence`: of sequences, whose entries share one
    ratio) with `ratio < 1 - epsilon` and A < 0 (low), `ratio > 1 + epsilon_high` and A > 0 (high), either
    (region); the smallest per-sample share low and the largest high."""
    ratio, advantages = ratio.detach(), x.advantages.detach()
    low = (ratio < 1.0 - epsilon) & (advantages < 0)
    high = (ratio > 1.0 + epsilon_high) & (advantages > 0)
    low_per_sample, high_per_sample = _per_sample_fractions(x.entry_sample, low, high, x.num_samples)

    def counted(flag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | float]:
        if not per_sequence:
            return flag.sum().float(), float(len(ratio))
        present = per_sequence_sum(torch.ones_like(ratio), x.entry_sample, x.sample_count()) > 0
        hit = per_sequence_sum(flag.to(ratio.dtype), x.entry_sample, x.sample_count()) > 0
        return (hit & present).sum().float(), present.sum().float()

    return {
        "clip_ratio/region_mean": Stat(Reduce.MEAN, *counted(low | high)),
        "clip_ratio/low_mean": Stat(Reduce.MEAN, *counted(low)),
        "clip_ratio/low_min": Stat(Reduce.MIN, low_per_sample),
        "clip_ratio/high_mean": Stat(Reduce.MEAN, *counted(high)),
        "clip_ratio/high_max": Stat(Reduce.MAX, high_per_sample),
    }


def sampling_metrics(x: LossInputs, c: Correction) -> dict[str, Stat]:
    """The sampling/* and entropy metrics, over the trained tokens (masked or not); none when the
    row has no entry (an empty extreme, max of nothing, would be wrong)."""
    rho = c.rho
    count = float(len(rho))
    if count == 0:
        return {}
    logp_diff = (x.logprobs.detach() - x.sampler_logprobs).abs()
    kl = mismatch_kl(x.logprobs, x.sampler_logprobs)
    metrics = {
        "sampling/sampling_logp_difference/mean": Stat(Reduce.MEAN, logp_diff.sum(), count),
        "sampling/sampling_logp_difference/max": Stat(Reduce.MAX, logp_diff.max()),
        "sampling/mismatch_kl/mean": Stat(Reduce.MEAN, kl.sum(), count),
        "sampling/mismatch_kl/max": Stat(Reduce.MAX, kl.max()),
        "sampling/importance_sampling_ratio/min": Stat(Reduce.MIN, rho.min()),
        "sampling/importance_sampling_ratio/mean": Stat(Reduce.MEAN, rho.sum(), count),
        "sampling/importance_sampling_ratio/max": Stat(Reduce.MAX, rho.max()),
        "sampling/masked_mean": Stat(Reduce.MEAN, (~c.keep).sum().float(), count),
    }
    metrics.update(_correction_metrics(x, c))
    if x.entropy is not None:
        metrics["entropy"] = Stat(Reduce.MEAN, x.entropy.detach().sum(), count)
    return metrics


def _correction_metrics(x: LossInputs, c: Correction) -> dict[str, Stat]:
    """The share of trained tokens, and of sequences (those with at least one such token), that the
    correction masked or truncated, by reason; `sampling/masked_sequences/any` for any mask."""
    num_samples = x.sample_count()
    present = per_sequence_sum(torch.ones_like(c.rho), x.entry_sample, num_samples) > 0
    count = float(len(c.rho))

    def tokens(flag: torch.Tensor) -> tuple[torch.Tensor, float]:
        return flag.sum().float(), count

    def sequences(flag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hit = per_sequence_sum(flag.to(c.rho.dtype), x.entry_sample, num_samples) > 0
        return (hit & present).sum().float(), present.sum().float()

    mean = Reduce.MEAN
    return {
        "sampling/masked_tokens/ratio_low": Stat(mean, *tokens(c.masked_low)),
        "sampling/masked_tokens/ratio_high": Stat(mean, *tokens(c.masked_high)),
        "sampling/masked_tokens/off_policy": Stat(mean, *tokens(c.masked_off_policy)),
        "sampling/truncated_tokens/low": Stat(mean, *tokens(c.truncated_low)),
        "sampling/truncated_tokens/high": Stat(mean, *tokens(c.truncated_high)),
        "sampling/masked_sequences/any": Stat(mean, *sequences(~c.keep)),
        "sampling/masked_sequences/ratio_low": Stat(mean, *sequences(c.masked_low)),
        "sampling/masked_sequences/ratio_high": Stat(mean, *sequences(c.masked_high)),
        "sampling/masked_sequences/off_policy": Stat(mean, *sequences(c.masked_off_policy)),
        "sampling/truncated_sequences/low": Stat(mean, *sequences(c.truncated_low)),
        "sampling/truncated_sequences/high": Stat(mean, *sequences(c.truncated_high)),
    }


def _per_sample_fractions(
    entry_sample: torch.Tensor, low: torch.Tensor, high: torch.Tensor, num_samples: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest fraction of a sample's trained tokens clipped low and the largest clipped high,
    over the samples that have entries (0-d tensors)."""
    entry_sample = entry_sample.long()
    if num_samples is None:
        num_samples = int(entry_sample.max()) + 1
    counts = torch.zeros(num_samples, dtype=torch.float32, device=entry_sample.device)
    counts.index_add_(0, entry_sample, torch.ones_like(low, dtype=torch.float32))
    low_count = torch.zeros_like(counts).index_add_(0, entry_sample, low.float())
    high_count = torch.zeros_like(counts).index_add_(0, entry_sample, high.float())
    present = counts > 0
    low_fraction = torch.where(present, low_count / counts.clamp(min=1), torch.inf)
    high_fraction = torch.where(present, high_count / counts.clamp(min=1), -torch.inf)
    return low_fraction.min(), high_fraction.max()
