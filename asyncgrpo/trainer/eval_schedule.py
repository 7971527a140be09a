"""Evaluation during training, on the trainer's side: when an evaluation starts, joins and reports.

`EvaluationSchedule` is a part of one train() call (the run's `evaluations`): at the points
transformers' callbacks ask for an evaluation, `start` has the servers given the step's weights
(`catch_up`) and starts rank 0's evaluator in the background; `join` waits for it on every rank and
hands its figures to `report` (the trainer logs them at the step they measure); `evaluate_now` is an
`evaluate()` call during the run. `evaluate_outside_run` serves an `evaluate()` call before or after
train(). The evaluator itself (trainer/evaluator.py) samples and scores; docs/architecture.md,
"Evaluation", tells the whole story.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.errors import ConfigurationError
from asyncgrpo.generation.background import BackgroundLoop
from asyncgrpo.generation.client import VLLMClient
from asyncgrpo.generation.server_list import starting_servers
from asyncgrpo.records.metrics import MetricsWindow
from asyncgrpo.trainer.distributed import Processes
from asyncgrpo.trainer.evaluator import Evaluator, dataset_rows
from asyncgrpo.trainer.generation_session import GenerationSession
from asyncgrpo.trainer.rollout_inputs import RolloutInputs

logger = logging.getLogger(__name__)

# (the global step whose weights were measured, the figures by metric name)
Joined = tuple[int, dict[str, float]]
# Logs a joined evaluation's figures at the step they measure (`trial` as transformers passes it).
Report = Callable[[int, dict[str, float], Any], dict[str, float]]


class EvaluationSchedule:
    """One run's evaluations: rank 0's evaluator (built on the session's HTTP loop when first needed,
    with the eval settings of `args` and the trainer's `rollout` inputs) and what every rank does
    around it. `eval_rows`: the trainer's eval datasets ({metric prefix: rows}), None without one;
    `catch_up`: the servers given the current weights if they lack them."""

    def __init__(
        self,
        processes: Processes,
        session: GenerationSession,
        args: AsyncGRPOConfig,
        rollout: RolloutInputs,
        eval_rows: dict[str, list[dict]] | None,
        window: MetricsWindow,
        report: Report,
        catch_up: Callable[[], None],
    ):
        self.processes = processes
        self.session = session
        self.args = args
        self.rollout = rollout
        self.eval_rows = eval_rows
        self.window = window  # where the wait for an evaluation is counted (perf/eval_wait_s)
        self.report = report
        self.catch_up = catch_up
        self.evaluator: Evaluator | None = None  # rank 0, once needed
        # Every rank, from the session's opening to the run's end: an evaluate() call is then collective.
        self.opened = False

    def open(self) -> None:
        """Every rank, once the session is open: evaluations may run. Rank 0 creates its evaluator
        now when the run has an eval dataset (a loop class that fails to build fails here), else at
        the first evaluate() call."""
        self.opened = True
        if self.processes.is_main and self.eval_rows is not None:
            self._evaluator()

    def _evaluator(self) -> Evaluator:
        if self.evaluator is None:
            session = self.session
            self.evaluator = Evaluator.of_run(
                self.args, self.rollout, session.http, session.client, session.served_name, session.lora_name
            )
        return self.evaluator

    def close(self) -> None:
        """The end of train(), also on an error: what still runs is dropped, the evaluator closed."""
        self.opened = False
        evaluator, self.evaluator = self.evaluator, None
        if evaluator is not None:
            evaluator.close()

    def start(self, step: int, trial) -> None:
        """Every rank: the servers get the weights of `step` (the current one) if they lack them, then
        rank 0 starts evaluating them in the background (joined later, `join`)."""
        self.join(trial)
        self.catch_up()
        if self.processes.is_main and self.eval_rows is not None:
            self._evaluator().start(self.eval_rows, step, self.session.model_version)

    def join(self, trial) -> None:
        """Every rank: wait for the running evaluation (the wait counts as `perf/eval_wait_s`) and
        report its figures at the step they measure."""
        waiting = time.perf_counter()
        joined = self.evaluator.join() if self.evaluator is not None else None
        joined = self.processes.broadcast(joined if self.processes.is_main else None)
        if joined is not None:
            self.window.record("perf/eval_wait_s", time.perf_counter() - waiting)
            self.report(*joined, trial)

    def evaluate_now(self, datasets: dict[str, list[dict]], step: int) -> dict[str, float]:
        """An evaluate() call during the run, of the weights of `step`. Every rank calls it (a
        callback runs on each): the weight push is collective, rank 0 samples and the figures reach
        every rank, as with the evaluations the schedule starts."""
        self.join(None)
        self.catch_up()
        joined = None
        if self.processes.is_main:
            evaluator = self._evaluator()
            evaluator.start(datasets, step, self.session.model_version)
            joined = evaluator.join()
        joined = self.processes.broadcast(joined)
        return self.report(*joined, None) if joined else {}


def evaluate_outside_run(
    args: AsyncGRPOConfig,
    rollout: RolloutInputs,
    datasets: dict[str, list[dict]],
    step: int,
    version: int,
    served_step: int | None,
) -> Joined | None:
    """An evaluate() call outside train(): the servers sampled as they are, through a client of its
    own. `served_step`: the step whose weights the last run left on the servers (None: no run yet).
    (step, figures), or None when the evaluation was discarded."""
    if served_step is not None and served_step != step:
        logger.warning(
            "evaluate(): the servers run the weights of step %d, the trainer holds step %d's",
            served_step,
            step,
        )
    http = BackgroundLoop(default_timeout_s=args.vllm_server_timeout + 60)
    urls = starting_servers(args.vllm_server_urls, args.vllm_server_urls_file)
    client = VLLMClient(urls, timeout=args.vllm_server_timeout)
    evaluator = None
    try:
        http.run(client.wait_until_ready())
        evaluator = Evaluator.of_run(args, rollout, http, client, http.run(client.model_name()))
        evaluator.start(datasets, step, version)
        return evaluator.join()
    finally:
        if evaluator is not None:
            evaluator.close()
        http.run(client.close(), timeout=10)
        http.close()


def named_eval_datasets(eval_dataset, prefix: str, trainer_eval_dataset=None) -> dict[str, list[dict]]:
    """{metric prefix: rows} as the base Trainer names them: one dataset under `prefix`, a dict under
    `prefix_name`; None takes the trainer's eval dataset, a name one dataset of the trainer's dict."""
    if isinstance(eval_dataset, str):
        eval_dataset = trainer_eval_dataset[eval_dataset]
    elif eval_dataset is None:
        eval_dataset = trainer_eval_dataset
    if eval_dataset is None:
        raise ConfigurationError(
            "evaluate() needs an eval dataset: pass eval_dataset= to AsyncGRPOTrainer or to evaluate()"
        )
    if isinstance(eval_dataset, dict):
        return {f"{prefix}_{name}": dataset_rows(part) for name, part in eval_dataset.items()}
    return {prefix: dataset_rows(eval_dataset)}
