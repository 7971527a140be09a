"""The row planner: which samples of the queue go into which process's row of a micro-batch.

Each row is a prefix trie capped at `token_budget` forwarded tokens (shared ones counted once) and
loss entries; samples are offered in queue order, stay with their group's row while it has room,
and spill only where it costs the micro-batch no time. With `token_budget <= 0` (TRL's fixed-count
mode) a row holds `samples_per_row` samples instead. The rules in full: docs/architecture.md,
"Tree packing"."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.packing.row import PackedRow
from asyncgrpo.packing.trie import PrefixTrie, prediction_targets
from asyncgrpo.records.sample import Sample

# The trainer's `min_shared_tokens` (see PrefixTrie): a prefix shorter than one attention block is not
# shared with samples whose own tails are longer than a block. 128 is the block size of the tree
# attention kernel (FlexAttention's default sparse block); a planner with another kernel would pick
# its own, which is why this is the planner's setting and not read from the kernel.
MIN_SHARED_TOKENS = 128


class Placement(enum.Enum):
    PLACED = "placed"
    CLOSED = "closed"  # the micro-batch is full: the sample was NOT placed, offer it to the next one
    DROPPED_OVERSIZE = "dropped_oversize"  # longer than token_budget on its own: never trainable


@dataclass
class MicroBatchPlan:
    """One micro-batch: a trie per process row (some possibly empty) and the `batch/*` counts."""

    tries: list[PrefixTrie]  # (num_rows,)
    token_budget: int  # <= 0: fixed-count rows, no token budget
    dropped_oversize_count: int  # samples dropped while this micro-batch was filling

    @property
    def rows(self) -> list[list[Sample]]:
        return [trie.samples for trie in self.tries]

    @property
    def num_samples(self) -> int:
        return sum(len(trie.samples) for trie in self.tries)

    @property
    def row_tokens(self) -> list[int]:
        """Forwarded tokens per row, shared tokens counted once."""
        return [trie.num_tokens for trie in self.tries]

    @property
    def row_attention_costs(self) -> list[int]:
        return [trie.attention_cost for trie in self.tries]

    @property
    def row_imbalance(self) -> float:
        """Most expensive row's attention cost / the mean over non-empty rows; 1.0 is perfect."""
        costs = [c for c in self.row_attention_costs if c > 0]
        return max(costs) / (sum(costs) / len(costs)) if costs else 1.0

    @property
    def row_fill_frac(self) -> float:
        """Mean forwarded tokens per row (empty rows included: their process idles) / token_budget;
        NaN for fixed-count rows, which have no budget to fill (a metrics window skips NaN)."""
        if self.token_budget <= 0:
            return math.nan
        return float(np.mean(self.row_tokens)) / self.token_budget

    def pack(self) -> list[PackedRow]:
        """The rows laid out, one per process; equal to `pack_row(row)` for each of `rows`."""
        return [trie.pack() for trie in self.tries]


class TokenBudgetBatcher:
    """Streams samples into micro-batches of `num_rows` rows of at most `token_budget` tokens, or,
    with `token_budget <= 0`, of `samples_per_row` samples each.

    Usage: `offer` each sample; on CLOSED call `close()` to take the plan and offer the same sample
    again (it opens the next micro-batch); call `close()` at the end for the last partial one.
    """

    def __init__(
        self, token_budget: int, num_rows: int, min_shared_tokens: int = 0, samples_per_row: int = 0
    ):
        if num_rows < 1:
            raise ValueError(f"num_rows (one per training process) must be >= 1, got {num_rows}")
        if token_budget <= 0 and samples_per_row < 1:
            raise ConfigurationError(
                f"token_budget={token_budget} (fixed-count rows) needs samples_per_row >= 1, got "
                f"{samples_per_row}"
            )
        self.token_budget = token_budget
        self.samples_per_row = samples_per_row if token_budget <= 0 else 0
        self.num_rows = num_rows
        self.min_shared_tokens = min_shared_tokens  # see PrefixTrie
        self._reset()

    def _reset(self) -> None:
        self._tries = [PrefixTrie(self.min_shared_tokens) for _ in range(self.num_rows)]
        self._group_rows: dict[int, list[int]] = {}  # group_id -> rows holding some of its samples
        self._dropped_oversize = 0

    @property
    def num_samples(self) -> int:
        """Samples placed in the micro-batch being filled."""
        return sum(len(trie.samples) for trie in self._tries)

    @property
    def fixed_count(self) -> bool:
        return self.samples_per_row > 0

    def offer(self, sample: Sample) -> Placement:
        if not self.fixed_count and sample.num_tokens > self.token_budget:
            self._dropped_oversize += 1
            return Placement.DROPPED_OVERSIZE
        targets = prediction_targets(sample.token_ids, sample.trained)  # (L,) computed once per offer
        if sample.group_id in self._group_rows:
            row = self._group_row(sample, targets)
            if row is None:
                row = self._spill_row(sample, targets)
        else:
            row = self._cheapest_fitting_row(sample, targets)
        if row is None:
            return Placement.CLOSED
        self._tries[row].add(sample, targets)
        rows = self._group_rows.setdefault(sample.group_id, [])
        if row not in rows:
            rows.append(row)
        return Placement.PLACED

    def close(self) -> MicroBatchPlan:
        """The micro-batch planned so far; the batcher starts an empty one."""
        plan = MicroBatchPlan(self._tries, self.token_budget, self._dropped_oversize)
        self._reset()
        return plan

    def _fits(self, row: int, added_tokens: int, sample: Sample) -> bool:
        trie = self._tries[row]
        if self.fixed_count:
            return len(trie.samples) < self.samples_per_row
        return (
            trie.num_tokens + added_tokens <= self.token_budget
            and trie.num_entries + sample.num_trained <= self.token_budget
        )

    def _group_row(self, sample: Sample, targets: np.ndarray) -> int | None:
        """The row holding the sample's group where it adds the fewest tokens, if one fits."""
        best, best_added = None, None
        for row in self._group_rows.get(sample.group_id, ()):
            added, _ = self._tries[row].growth(sample, targets)
            if self._fits(row, added, sample) and (best_added is None or added < best_added):
                best, best_added = row, added
        return best

    def _spill_row(self, sample: Sample, targets: np.ndarray) -> int | None:
        """For a sample whose group's rows are full: an empty row, else the cheapest fitting row
        provided its cost does not exceed the most loaded row's (fixed-count rows: any row with
        room, as the count, not the cost, decides when the micro-batch is full); None closes the
        micro-batch."""
        for row, trie in enumerate(self._tries):
            if not trie.samples:
                return row
        max_cost = max(trie.attention_cost for trie in self._tries)
        best, best_cost = self._cheapest(sample, targets)
        if best_cost is None or (best_cost > max_cost and not self.fixed_count):
            return None
        return best

    def _cheapest_fitting_row(self, sample: Sample, targets: np.ndarray) -> int | None:
        return self._cheapest(sample, targets)[0]

    def _cheapest(self, sample: Sample, targets: np.ndarray) -> tuple[int | None, int | None]:
        """The row that fits the sample with the lowest attention cost after adding it."""
        best, best_cost = None, None
        for row, trie in enumerate(self._tries):
            added, added_cost = trie.growth(sample, targets)
            cost = trie.attention_cost + added_cost
            if self._fits(row, added, sample) and (best_cost is None or cost < best_cost):
                best, best_cost = row, cost
        return best, best_cost
