"""The evaluator: held-out figures of the policy the servers run, computed while training goes on.

Rank 0 starts an evaluation right after the weights of the step it reports reached the servers; it
runs on the trainer's HTTP event loop (a background thread) while the training loop carries on with
the next step. The trainer joins it before anything that would change what it measures or needs its
figures: the next weight sync, a checkpoint, the next evaluation, the end of training. The figures
are logged at the step they measure. The servers' weight labels are read when it starts and
reported with every sampled token: an evaluation that saw other weights than the ones it started on
is discarded with a warning, never logged as the step's (docs/architecture.md, "Evaluation"). So is
one a teacher failed on (the run's teachers score its completions): its figures would lack the
teacher's, which a user may judge the best model by, and training goes on either way.
"""

from __future__ import annotations

import copy
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from asyncgrpo.errors import ConfigurationError, WeightSyncError
from asyncgrpo.generation.background import BackgroundLoop
from asyncgrpo.generation.client import VLLMClient
from asyncgrpo.rollout.eval_metrics import summarize
from asyncgrpo.rollout.evaluation import EvalRunner, EvalTeacherFailed
from asyncgrpo.trainer.rollout_inputs import RolloutInputs

logger = logging.getLogger(__name__)


class EvalWeightsChanged(WeightSyncError):
    """The servers ran other weights during an evaluation than when it started."""


def eval_config(args):
    """The run's config with the eval settings where the rollout loop reads the training ones."""
    config = copy.copy(args)
    config.num_generations = args.num_generations_eval
    config.temperature = args.temperature_eval
    # Nothing sampled here is trained on: the sampler's top log-probs would only cost the server.
    config.score_centering = False
    return config


def dataset_rows(dataset) -> list[dict[str, Any]]:
    """An eval dataset's rows as dicts (a datasets.Dataset, a list of dicts, anything indexable)."""
    if not hasattr(dataset, "__len__"):
        raise TypeError(
            "the eval dataset needs a length: every evaluation samples all of its rows (an IterableDataset "
            "has none; take a fixed number of rows with `.take(n)` and `Dataset.from_list`)"
        )
    if len(dataset) == 0:
        raise ConfigurationError("the eval dataset is empty: give it at least one row")
    return [dict(dataset[index]) for index in range(len(dataset))]


@dataclass
class PendingEval:
    step: int  # the global step whose weights it measures
    future: Future  # -> the figures, prefixed


class Evaluator:
    """Rank 0's evaluations on `http`'s event loop with `client`; one in flight at a time."""

    def __init__(self, http: BackgroundLoop, client: VLLMClient, runner: EvalRunner, pass_threshold: float):
        self.http = http
        self.client = client
        self.runner = runner
        self.threshold = pass_threshold
        self._opened = False
        self.pending: PendingEval | None = None

    @classmethod
    def of_run(
        cls,
        args,
        rollout: RolloutInputs,
        http: BackgroundLoop,
        client: VLLMClient,
        model_name: str,
        lora_name: str | None = None,
    ) -> Evaluator:
        """The run's evaluator: the trainer's rollout loop class, reward functions, tools and
        environments, with the eval settings of `args`; `lora_name`: the policy adapters' prefix
        (adapter-only weight sync)."""
        runner = EvalRunner(
            rollout.loop_cls,
            # The eval rows are handed to each run, never to a prompt stream.
            rollout.loop_kwargs(eval_config(args), model_name, dataset=None, lora_name=lora_name),
            client,
            rollout.reward_funcs,
            seed=args.seed,
        )
        return cls(http, client, runner, args.eval_pass_threshold)

    def start(self, datasets: dict[str, list[dict[str, Any]]], step: int, version: int) -> None:
        """Start evaluating `datasets` ({metric prefix: rows}) under policy `version` (the step's),
        without waiting for it. The previous evaluation must have been joined."""
        assert self.pending is None, "join the running evaluation first"
        if not self._opened:
            self.http.run(self.runner.open())
            self._opened = True
        self.pending = PendingEval(step, self.http.submit(self._measure(datasets, version)))

    def join(self) -> tuple[int, dict[str, float]] | None:
        """Wait for the running evaluation: (its step, its figures), or None when none runs or it was
        discarded because the servers' weights changed under it or a teacher failed on it."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        try:
            return pending.step, pending.future.result(self.http.default_timeout_s)
        except (EvalWeightsChanged, EvalTeacherFailed) as error:
            logger.warning("the evaluation of step %d is discarded: %s", pending.step, error)
            return None

    def close(self) -> None:
        """Join what runs (its figures are lost: the run is ending on an error) and close the runner."""
        if self.pending is not None:
            self.pending.future.cancel()
            self.pending = None
        if self._opened:
            self.http.run(self.runner.close())
            self._opened = False

    async def _measure(self, datasets: dict[str, list[dict[str, Any]]], version: int) -> dict[str, float]:
        figures: dict[str, float] = {}
        for prefix, rows in datasets.items():
            started = time.perf_counter()
            labels = set(await self.client.weight_labels())
            if len(labels) > 1:
                raise EvalWeightsChanged(f"the servers run different weights ({sorted(labels)})")
            outcomes, seen = await self.runner.run(rows, version)
            after = set(await self.client.weight_labels())
            if not seen <= labels or after != labels:
                raise EvalWeightsChanged(
                    f"it started on weights {sorted(labels)} but sampled with {sorted(seen | after)}"
                )
            runtime = time.perf_counter() - started
            measured = summarize(outcomes, self.threshold, self.runner.several_teachers)
            measured["runtime"] = runtime
            measured["samples_per_second"] = len(rows) / runtime
            measured["model_version"] = float(version)
            figures.update({f"{prefix}_{name}": value for name, value in measured.items()})
        return figures
