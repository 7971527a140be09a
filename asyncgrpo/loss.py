"""The policy losses: pure tensor functions returning `(loss, metrics)`.

Both losses use masked importance sampling against the sampler's (vLLM's processed) log-probs, and
divide the micro-batch's sum by its trained tokens counted over all processes (masked ones included,
known from the plan) and by `gradient_accumulation_steps`. DDP and FSDP average gradients, so the
caller multiplies the loss by the world size before backward: this module never sees
torch.distributed. `epsilon_high` has one default, in AsyncGRPOConfig. docs/algorithm.md derives the
formulas. Metrics are `Stat`s whose merge across micro-batches and processes is exact (means carry
their (sum, count)); values are detached 0-d tensors, converted by whoever logs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncgrpo.metrics import Reduce, Stat

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


def importance_ratio(
    logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, clip_min: float, clip_max: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """rho (E,) without gradient, and mask (E,) bool: clip_min <= rho <= clip_max."""
    rho = torch.exp(logprobs.detach() - sampler_logprobs)
    return rho, (rho >= clip_min) & (rho <= clip_max)


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
    clip_min: float,
    clip_max: float,
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
    and epsilon_high only define the clip_ratio/* metrics (tokens outside the trust region).
    """
    if x.top_logprobs is None or x.sampler_top_logprobs is None:
        raise ValueError(
            "score centering needs the sampler's top-N log-probs of every trained token: set "
            "num_sampler_logprobs > 0, or score_centering=False"
        )
    if x.top_logprobs.shape != x.sampler_top_logprobs.shape:
        raise ValueError(
            f"trainer top log-probs {tuple(x.top_logprobs.shape)} and sampler top log-probs "
            f"{tuple(x.sampler_top_logprobs.shape)} must be gathered at the same ids"
        )
    rho, mask = importance_ratio(x.logprobs, x.sampler_logprobs, clip_min, clip_max)
    coefficients = centering_coefficients(x.top_logprobs, x.sampler_top_logprobs)  # (E, N)
    # Padded ids (and ids outside the candidate set) have log p = -inf and coefficient 0.
    valid = x.top_logprobs > float("-inf")
    centering = (coefficients * x.top_logprobs.masked_fill(~valid, 0.0)).sum(-1)
    per_token = -x.advantages * (x.logprobs - centering)
    loss = _normalize(per_token, mask, num_trained_tokens_global, gradient_accumulation_steps)

    metrics = _shared_metrics(x, rho, mask, epsilon, epsilon_high)
    if len(rho):
        sampler_mass = x.sampler_top_logprobs.detach().exp().sum(-1)  # Q_H (E,)
        metrics["sampling/sampler_mass"] = Stat(Reduce.MEAN, sampler_mass.sum(), float(len(rho)))
    return loss, metrics


def clipped_surrogate_loss(
    x: LossInputs,
    *,
    clip_min: float,
    clip_max: float,
    epsilon: float,
    epsilon_high: float,
    num_trained_tokens_global: float,
    gradient_accumulation_steps: int,
) -> tuple[torch.Tensor, dict[str, Stat]]:
    """GRPO's clipped surrogate with the masked ratio (score_centering=False): per entry
    `loss_t = -m_t * min(rho_t * A_t, clip(rho_t, 1 - epsilon, 1 + epsilon_high) * A_t)`."""
    rho_sg, mask = importance_ratio(x.logprobs, x.sampler_logprobs, clip_min, clip_max)
    # Recomputed with gradient: exp of -inf (a target outside the candidate set) is a finite 0.
    rho = torch.exp(x.logprobs - x.sampler_logprobs)
    advantages = x.advantages
    clipped = torch.clamp(rho, 1.0 - epsilon, 1.0 + epsilon_high)
    per_token = -torch.minimum(rho * advantages, clipped * advantages)
    loss = _normalize(per_token, mask, num_trained_tokens_global, gradient_accumulation_steps)
    return loss, _shared_metrics(x, rho_sg, mask, epsilon, epsilon_high)


def _normalize(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    num_trained_tokens_global: float,
    gradient_accumulation_steps: int,
) -> torch.Tensor:
    """sum_t m_t * loss_t / num_trained_tokens_global / gradient_accumulation_steps."""
    if not num_trained_tokens_global > 0:
        raise ValueError(
            f"num_trained_tokens_global must be > 0 (the micro-batch's trained tokens summed over all "
            f"processes), got {num_trained_tokens_global}"
        )
    if gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
    # where, not multiply: a masked token's term may be inf (log p = -inf) and 0 * inf is NaN.
    kept = torch.where(mask, per_token, torch.zeros_like(per_token))
    return kept.sum() / (float(num_trained_tokens_global) * gradient_accumulation_steps)


def _shared_metrics(
    x: LossInputs, rho: torch.Tensor, mask: torch.Tensor, epsilon: float, epsilon_high: float
) -> dict[str, Stat]:
    """The sampling/*, entropy and clip_ratio/* metrics, over the trained tokens (masked or not)."""
    count = float(len(rho))
    if count == 0:  # nothing to report; an empty extreme (max of nothing) would be wrong
        return {}
    advantages = x.advantages.detach()
    logp_diff = (x.logprobs.detach() - x.sampler_logprobs).abs()
    low = (rho < 1.0 - epsilon) & (advantages < 0)
    high = (rho > 1.0 + epsilon_high) & (advantages > 0)
    low_per_sample, high_per_sample = _per_sample_fractions(x.entry_sample, low, high, x.num_samples)
    metrics = {
        "sampling/sampling_logp_difference/mean": Stat(Reduce.MEAN, logp_diff.sum(), count),
        "sampling/sampling_logp_difference/max": Stat(Reduce.MAX, logp_diff.max()),
        "sampling/importance_sampling_ratio/min": Stat(Reduce.MIN, rho.min()),
        "sampling/importance_sampling_ratio/mean": Stat(Reduce.MEAN, rho.sum(), count),
        "sampling/importance_sampling_ratio/max": Stat(Reduce.MAX, rho.max()),
        "sampling/masked_mean": Stat(Reduce.MEAN, (~mask).sum().float(), count),
        "clip_ratio/region_mean": Stat(Reduce.MEAN, (low | high).sum().float(), count),
        "clip_ratio/low_mean": Stat(Reduce.MEAN, low.sum().float(), count),
        "clip_ratio/low_min": Stat(Reduce.MIN, low_per_sample),
        "clip_ratio/high_mean": Stat(Reduce.MEAN, high.sum().float(), count),
        "clip_ratio/high_max": Stat(Reduce.MAX, high_per_sample),
    }
    if x.entropy is not None:
        metrics["entropy"] = Stat(Reduce.MEAN, x.entropy.detach().sum(), count)
    return metrics


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
