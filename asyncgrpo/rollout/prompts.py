"""The stream of prompts the worker generates for: epochs over the dataset, shuffled per epoch.

Each prompt has a stream index `epoch * len(dataset) + k` (k = its place in that epoch's order).
The order of epoch e is a permutation drawn from (seed, e), so a resumed run rebuilds exactly the
same stream and starts at the first untrained index (`dataset_start_index`), skipping the indices
after it that were already trained (`skip_stream_indices`). The order's seed is the config's
`data_seed`, or `seed` when it is unset (as transformers' samplers do);
`train_sampling_strategy="sequential"` keeps the dataset's order in every epoch. A checkpoint
records the order (`PromptOrder`), and a resume in another order is refused: its positions would
name other prompts.
"""

from __future__ import annotations

import contextvars
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncgrpo.errors import ConfigurationError

# The dataset row of the rollout being generated, set by the scheduler around each `generate_one`
# (each rollout runs in its own asyncio task, so each sees its own row). `generate_one` gets the prompt
# alone, as in TRL; a loop whose rollouts need the row's other columns (the harness's task.json) reads it
# through `AsyncRolloutLoop.dataset_row()`.
CURRENT_ROW: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("asyncgrpo_current_row")


@dataclass(frozen=True)
class PromptItem:
    stream_index: int
    epoch: int
    row_index: int
    row: dict[str, Any]


@dataclass(frozen=True)
class PromptOrder:
    """How each epoch orders the prompts: a permutation drawn from `seed`, or (None) the dataset's."""

    seed: int | None

    @classmethod
    def of(cls, config: Any) -> PromptOrder:
        """The order a config asks for; `train_sampling_strategy` values other than "sequential"
        shuffle (the config warns about those it cannot honour)."""
        if config.train_sampling_strategy == "sequential":
            return cls(None)
        return cls(int(config.seed if config.data_seed is None else config.data_seed))

    def describe(self) -> str:
        return "in dataset order" if self.seed is None else f"shuffled with seed {self.seed}"


@dataclass(frozen=True)
class StreamStart:
    """Where a worker's prompt stream resumes: the first untrained stream index, and the indices
    after it that were already trained (a fresh run: 0 and none)."""

    first_index: int = 0
    skip: frozenset[int] = frozenset()


def _is_iterable_dataset(dataset: Any) -> bool:
    return not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__")


def epoch_order(num_rows: int, seed: int | None, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s row order: a permutation drawn from (seed, epoch); seed None: dataset order."""
    if seed is None:
        return np.arange(num_rows)
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def prompt_stream(
    dataset: Any,
    seed: int | None,
    start_index: int = 0,
    skip_stream_indices: frozenset[int] = frozenset(),
) -> Iterator[PromptItem]:
    """Endless stream of prompts (the trainer decides when to stop), each epoch shuffled by `seed`
    (None: in the dataset's order)."""
    if _is_iterable_dataset(dataset):
        # A stream cannot seek: a resumed run restarts it from its first prompt (the trainer warns).
        yield from _iterable_stream(dataset, seed)
        return
    num_rows = len(dataset)
    if num_rows == 0:
        raise ConfigurationError("train_dataset is empty: there is nothing to generate from")
    epoch, position = divmod(start_index, num_rows)
    while True:
        order = epoch_order(num_rows, seed, epoch)
        for k in range(position, num_rows):
            stream_index = epoch * num_rows + k
            if stream_index in skip_stream_indices:
                continue
            row_index = int(order[k])
            yield PromptItem(stream_index, epoch, row_index, dataset[row_index])
        epoch, position = epoch + 1, 0


def _iterable_stream(dataset: Any, seed: int | None) -> Iterator[PromptItem]:
    """A streaming dataset, epoch after epoch, from its first prompt."""
    stream_index = 0
    for epoch in itertools.count():
        source = dataset
        if seed is not None and hasattr(dataset, "shuffle"):
            source = dataset.shuffle(seed=seed + epoch, buffer_size=1000)
        empty = True
        for row_index, row in enumerate(source):
            empty = False
            yield PromptItem(stream_index, epoch, row_index, row)
            stream_index += 1
        if empty:
            raise ConfigurationError("train_dataset (IterableDataset) yielded no rows")
