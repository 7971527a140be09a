"""The loss menu: TRL 1.16's GRPO loss types beside the seed's losses (asyncgrpo/loss.py), the KL to a
reference and the entropy terms, composed per row by `algorithm_loss` (docs/algorithm.md)."""

from asyncgrpo.losses.aggregation import LossTotals
from asyncgrpo.losses.algorithm import STEP_TOTAL_METRICS, AlgorithmSettings, algorithm_loss
from asyncgrpo.losses.regularizers import EntropyCoefficient

__all__ = ["STEP_TOTAL_METRICS", "AlgorithmSettings", "EntropyCoefficient", "LossTotals", "algorithm_loss"]
