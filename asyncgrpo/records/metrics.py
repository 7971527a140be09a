"""Metrics with their reduction declared where they are recorded.

Window rules (docs/metrics.md): per-rollout/sample/call values are averaged over the logging window;
a rate is total over total; a name whose last part contains `count` is summed; `max`/`min` keep the
extreme. Guessing the rule from a name breaks on user-chosen names (a reward function called
`max_score` must still be averaged), so every record says how it reduces.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from asyncgrpo.errors import ContractError


class Reduce(enum.Enum):
    MEAN = "mean"  # sum(value * weight) / sum(weight)
    SUM = "sum"
    MAX = "max"
    MIN = "min"
    RATE = "rate"  # sum(amount) / sum(seconds): record amount as value and seconds as weight
    LAST = "last"  # a gauge: the latest value


@dataclass
class Stat:
    """One accumulator. For MEAN, `value` is the weighted sum and `weight` the total weight."""

    reduce: Reduce
    value: float
    weight: float = 1.0

    def merge(self, other: "Stat") -> None:
        if other.reduce is not self.reduce:
            raise ContractError(f"metric recorded with {self.reduce.value} and {other.reduce.value}")
        if self.reduce in (Reduce.MEAN, Reduce.SUM, Reduce.RATE):
            self.value += other.value
            self.weight += other.weight
        elif self.reduce is Reduce.MAX:
            self.value = max(self.value, other.value)
        elif self.reduce is Reduce.MIN:
            self.value = min(self.value, other.value)
        else:
            self.value, self.weight = other.value, other.weight

    def result(self) -> float:
        if self.reduce in (Reduce.MEAN, Reduce.RATE):
            return self.value / self.weight if self.weight else math.nan
        return self.value


class MetricsWindow:
    """Everything recorded since the last log line."""

    def __init__(self) -> None:
        self._stats: dict[str, Stat] = {}

    def record(self, name: str, value: float, reduce: Reduce = Reduce.MEAN, weight: float = 1.0) -> None:
        """Record one observation. For MEAN, `value` is one observation of weight `weight`."""
        if reduce is Reduce.MEAN:
            value = value * weight
        self.add(name, Stat(reduce, float(value), float(weight)))

    def record_rate(self, name: str, amount: float, seconds: float) -> None:
        self.add(name, Stat(Reduce.RATE, float(amount), float(seconds)))

    def add(self, name: str, stat: Stat) -> None:
        if isinstance(stat.value, float) and math.isnan(stat.value) and stat.reduce is not Reduce.LAST:
            return  # NaN observations (nothing scored) do not poison a window's mean
        current = self._stats.get(name)
        if current is None:
            self._stats[name] = Stat(stat.reduce, stat.value, stat.weight)
        else:
            current.merge(stat)

    def merge(self, stats: dict[str, Stat]) -> None:
        for name, stat in stats.items():
            self.add(name, stat)

    def stats(self) -> dict[str, Stat]:
        return self._stats

    def summarize(self) -> dict[str, float]:
        """The window's values, and a fresh window."""
        out = {name: stat.result() for name, stat in sorted(self._stats.items())}
        self._stats = {}
        return out
