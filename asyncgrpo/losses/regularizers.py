"""The terms beside the policy loss: the KL to a reference, the high-entropy token mask and the entropy
bonus with its adaptive coefficient (TRL 1.16's semantics; docs/algorithm.md, "KL to a reference" and
"Entropy"). Pure tensor functions, plus the coefficient's small state machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def reference_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """(E,) per-token KL(policy || reference) by the k3 estimator, exp(d) - d - 1 with d = log p_ref -
    log p_theta: never negative, 0 where the two agree; gradient through log p_theta."""
    difference = ref_logprobs - logprobs
    return torch.exp(difference) - difference - 1.0


def entropy_threshold(entropies: torch.Tensor, top_entropy_quantile: float) -> torch.Tensor:
    """The entropy at the (1 - top_entropy_quantile) quantile of `entropies` (every trained token of the
    micro-batch, all processes), linearly interpolated as torch.quantile does; +inf when there is none
    (every token then leaves the policy term, as in TRL)."""
    values = entropies.detach().float().reshape(-1)
    if values.numel() == 0:
        return torch.tensor(math.inf)
    return torch.quantile(values, 1.0 - top_entropy_quantile)


def high_entropy_mask(entropy: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """(E,) bool: the tokens whose entropy is at or above the micro-batch's threshold (Beyond the 80/20
    Rule): the forking tokens, where the policy term is kept."""
    return entropy.detach() >= threshold.to(entropy.device, entropy.dtype)


def entropy_bonus(
    entropy: torch.Tensor, mask: torch.Tensor | None, coefficient: float, step_rows: int
) -> torch.Tensor:
    """The row's share of -coefficient x mean entropy: TRL's bonus is the mean entropy of the local batch
    (here a row) over the tokens the policy term acts on, averaged over the step's rows, whatever the
    loss type. Subtract it from the loss."""
    weights = torch.ones_like(entropy) if mask is None else mask.to(entropy.dtype)
    mean = (entropy * weights).sum() / weights.sum().clamp(min=1.0)
    return coefficient * mean / step_rows


@dataclass
class EntropyCoefficient:
    """The entropy bonus's coefficient across steps. Static: `entropy_coef` throughout. Adaptive
    (Skywork-OR1): the coefficient applied in a step is the one the previous step's end left, and only
    while the previous step's entropy was at or below the target; after each step it moves by `delta`
    toward more bonus when the step's entropy is at or below the target, toward less otherwise, within
    [minimum, maximum]. Before any step the entropy is unknown (inf): no bonus, as in TRL."""

    coefficient: float
    adaptive: bool = False
    target: float = 0.2
    delta: float = 0.005
    minimum: float = 0.0
    maximum: float = 1.0
    last_entropy: float = math.inf

    @property
    def enabled(self) -> bool:
        """Whether the bonus is part of the loss at all (adaptive: always, so it can come back)."""
        return self.adaptive or self.coefficient != 0.0

    def applied(self) -> float:
        """The coefficient this step's rows use."""
        if self.adaptive and not self.last_entropy <= self.target:
            return 0.0
        return self.coefficient

    def update(self, step_entropy: float) -> None:
        """After an optimizer step: `step_entropy` is the step's mean entropy over the tokens the bonus
        acted on, every row of every process."""
        if not self.adaptive or math.isnan(step_entropy):
            return
        if step_entropy <= self.target:
            self.coefficient = min(self.coefficient + self.delta, self.maximum)
        else:
            self.coefficient = max(self.coefficient - self.delta, self.minimum)
        self.last_entropy = step_entropy

    def state(self) -> dict:
        return {"coefficient": self.coefficient, "last_entropy": self.last_entropy}

    def load_state(self, state: dict) -> None:
        self.coefficient = float(state["coefficient"])
        self.last_entropy = float(state["last_entropy"])
