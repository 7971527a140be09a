"""The loss menu: TRL 1.16's GRPO loss types beside asyncgrpo's own losses (asyncgrpo/losses/policy_loss.py),
the KL to a reference and the entropy terms, composed per row by `algorithm_loss` (docs/algorithm.md)."""

from asyncgrpo.losses.aggregation import LossTotals
from asyncgrpo.losses.algorithm import AlgorithmSettings, algorithm_loss
from asyncgrpo.losses.regularizers import EntropyCoefficient

__all__ = ["AlgorithmSettings", "EntropyCoefficient", "LossTotals", "algorithm_loss"]
