"""The per-token policy terms of TRL's loss types, as pure tensor functions of (E,) entries.

`coef` is the importance ratio the loss carries (exp of `ratios.log_importance_weights`, with gradient),
`advantages` the entry's rollout advantage, `logprobs` the trainer's log p(y_t). Each returns the (E,)
per-token loss before masks, the correction factor and normalization (losses/aggregation.py).
docs/algorithm.md derives each formula and cites its paper.
"""

from __future__ import annotations

import math

import torch

from asyncgrpo.losses.off_policy import per_sequence_sum

# VESPO works in log space with TRL's clamps: a log ratio per token within +-20, a sequence's log weight
# within [log 1e-8, 20] (the original implementation's floor).
_VESPO_TOKEN_LOG_CLAMP = 20.0
_VESPO_LOG_FLOOR = math.log(1e-8)


def clipped_term(
    coef: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
) -> torch.Tensor:
    """GRPO's clipped surrogate (grpo, dr_grpo, dapo, bnpo, luspo): -min(r A, clip(r, 1 - eps_low,
    1 + eps_high) A); with `delta` (INTELLECT-2's two-sided clipping) the unclipped r is capped at delta."""
    clipped = torch.clamp(coef, 1.0 - epsilon_low, 1.0 + epsilon_high)
    if delta is not None:
        coef = torch.clamp(coef, max=delta)
    return -torch.minimum(coef * advantages, clipped * advantages)


def cispo_term(
    coef: torch.Tensor, advantages: torch.Tensor, logprobs: torch.Tensor, epsilon_high: float
) -> torch.Tensor:
    """CISPO (MiniMax-M1): -sg(min(r, eps_high)) A log p. The weight, not the update, is clipped: every
    token keeps a gradient, bounded by eps_high (TRL reads epsilon_high as the cap itself)."""
    return -torch.clamp(coef, max=epsilon_high).detach() * advantages * logprobs


def sapo_term(
    coef: torch.Tensor, advantages: torch.Tensor, temperature_pos: float, temperature_neg: float
) -> torch.Tensor:
    """SAPO: -sigmoid(tau (r - 1)) 4 / tau A, tau = temperature_pos where A > 0 else temperature_neg. Its
    gradient weight 4 sigma'(tau (r - 1)) r is 1 at r = 1 and fades smoothly off-policy."""
    temperature = torch.where(
        advantages > 0,
        torch.as_tensor(temperature_pos, dtype=coef.dtype, device=coef.device),
        torch.as_tensor(temperature_neg, dtype=coef.dtype, device=coef.device),
    )
    return -torch.sigmoid(temperature * (coef - 1.0)) * 4.0 / temperature * advantages


@torch.no_grad()
def vespo_weights(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    entry_sample: torch.Tensor,
    num_samples: int,
    correction: torch.Tensor | None,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
) -> torch.Tensor:
    """(E,) VESPO's gamma weight phi(w) = e^lambda w^k e^(-lambda w) of each entry's sequence (phi(1) = 1),
    no gradient. w = prod_t rho_t over the sequence, times the correction factor of each of its tokens
    when given (TRL folds its per-token importance weights in here instead of multiplying the loss);
    (k, lambda) by the sign of the sequence's advantage."""
    log_seq = per_sequence_sum(
        log_ratio.detach().clamp(-_VESPO_TOKEN_LOG_CLAMP, _VESPO_TOKEN_LOG_CLAMP), entry_sample, num_samples
    )
    if correction is not None:
        log_correction = torch.log(correction).clamp(_VESPO_LOG_FLOOR, _VESPO_TOKEN_LOG_CLAMP)
        log_seq = log_seq + per_sequence_sum(log_correction, entry_sample, num_samples)
    log_w = log_seq.clamp(_VESPO_LOG_FLOOR, _VESPO_TOKEN_LOG_CLAMP)
    sample_advantage = torch.zeros_like(log_w).index_copy_(0, entry_sample.long(), advantages.detach())
    non_negative = sample_advantage >= 0
    k = torch.where(non_negative, k_pos, k_neg).to(log_w.dtype)
    lam = torch.where(non_negative, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return phi[entry_sample.long()]


def vespo_term(phi: torch.Tensor, advantages: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """VESPO: -phi A log p, whose gradient is phi A grad log p (phi carries no gradient)."""
    return -phi * advantages * logprobs
