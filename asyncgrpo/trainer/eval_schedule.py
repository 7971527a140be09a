"""Evaluation during training, on the trainer's side: when an evaluation starts, joins and logs.

`TrainerEvaluation` is a part of AsyncGRPOTrainer (a base class of it, never used alone). It holds
`evaluate` (transformers' `Trainer.evaluate`, overridden) and what the loop calls at the points
transformers' callbacks ask for an evaluation: `_start_eval` gives the servers the step's weights and
starts rank 0's evaluator in the background, `_join_eval` waits for it (every rank) and
`_report_eval` logs its figures at the step they measure and tracks the best one. The evaluator
itself (trainer/evaluator.py) samples and scores; docs/architecture.md, "Evaluation", tells the whole
story.
"""

from __future__ import annotations

import logging
import time

from transformers.trainer_utils import SaveStrategy

from asyncgrpo.checkpoints.layout import is_sharded
from asyncgrpo.errors import ConfigurationError
from asyncgrpo.generation.background import BackgroundLoop
from asyncgrpo.generation.client import VLLMClient
from asyncgrpo.trainer.checkpoint import load_sharded_weights
from asyncgrpo.trainer.evaluator import Evaluator, dataset_rows
from asyncgrpo.trainer.server_roster import read_server_list

logger = logging.getLogger(__name__)


class TrainerEvaluation:
    """AsyncGRPOTrainer's evaluations; they read the trainer's `args`, `state`, `control`,
    `eval_dataset`, `_eval_rows`, `_evaluator`, `_in_run`, `_session`, `_processes`, `_metrics` and
    `_served_step`, and push weights through its `_push_weights`."""

    def evaluate(
        self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Held-out figures of the policy the servers run (`Trainer.evaluate`'s arguments; a dict of
        datasets prefixes each name, `eval_{name}_reward`). During train() the servers are first given
        the current weights; outside it they are sampled as they are: before train() they run the
        checkpoint they were started with, after it the final weights (train() ends with them pushed
        when the run has an eval dataset). `ignore_keys` has no meaning here (no model outputs)."""
        datasets = self._eval_datasets(eval_dataset, metric_key_prefix)
        if self._in_run:
            # Every rank calls it (a callback runs on each): the weight push is collective, rank 0
            # samples and the figures reach every rank, as with the evaluations the schedule starts.
            self._join_eval(None)
            self._catch_up_server_weights()
            joined = None
            if self._processes.is_main:
                evaluator = self._run_evaluator()
                evaluator.start(datasets, self.state.global_step, self._session.model_version)
                joined = evaluator.join()
            joined = self._processes.broadcast(joined)
            return self._report_eval(*joined, None) if joined else {}
        http = BackgroundLoop(default_timeout_s=self.args.vllm_server_timeout + 60)
        urls = self.args.vllm_server_urls or read_server_list(self.args.vllm_server_urls_file)
        client = VLLMClient(urls, timeout=self.args.vllm_server_timeout)
        evaluator = None
        try:
            http.run(client.wait_until_ready())
            evaluator = Evaluator.for_trainer(self, http, client, http.run(client.model_name()))
            if self._session is not None and self._served_step != self.state.global_step:
                logger.warning(
                    "evaluate(): the servers run the weights of step %d, the trainer holds step %d's",
                    self._served_step,
                    self.state.global_step,
                )
            evaluator.start(datasets, self.state.global_step, self.model_version)
            figures = evaluator.join()
        finally:
            if evaluator is not None:
                evaluator.close()
            http.run(client.close(), timeout=10)
            http.close()
        return self._report_eval(*figures, None) if figures else {}

    def _eval_datasets(self, eval_dataset, prefix: str) -> dict[str, list[dict]]:
        """{metric prefix: rows} as the base Trainer names them: one dataset under `prefix`, a dict
        under `prefix_name`, a name picks one dataset of the trainer's dict."""
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ConfigurationError(
                "evaluate() needs an eval dataset: pass eval_dataset= to AsyncGRPOTrainer or to evaluate()"
            )
        if isinstance(dataset, dict):
            return {f"{prefix}_{name}": dataset_rows(part) for name, part in dataset.items()}
        return {prefix: dataset_rows(dataset)}

    def _open_evaluator(self) -> None:
        """Every rank, once train()'s session is open: evaluations may run. Rank 0 creates its
        evaluator now when the run has an eval dataset (a loop class that fails to build fails here),
        else at the first evaluate() call."""
        self._in_run = True
        if self._processes.is_main and self._eval_rows is not None:
            self._run_evaluator()

    def _run_evaluator(self) -> Evaluator:
        """Rank 0's evaluator of the run, on the session's HTTP loop."""
        if self._evaluator is None:
            session = self._session
            self._evaluator = Evaluator.for_trainer(
                self, session.http, session.client, session.served_name, session.lora_name
            )
        return self._evaluator

    def _close_evaluator(self) -> None:
        """The end of train(), also on an error: what still runs is dropped, the evaluator closed."""
        self._in_run = False
        evaluator, self._evaluator = self._evaluator, None
        if evaluator is not None:
            evaluator.close()

    def _start_eval(self, trial) -> None:
        """Every rank: the servers get this step's weights if they lack them, then rank 0 starts
        evaluating them in the background (joined later, `_join_eval`)."""
        self.control.should_evaluate = False
        self._join_eval(trial)
        self._catch_up_server_weights()
        if self._processes.is_main and self._eval_rows is not None:
            self._run_evaluator().start(self._eval_rows, self.state.global_step, self._session.model_version)

    def _join_eval(self, trial) -> None:
        """Every rank: wait for the running evaluation (the wait counts as `perf/eval_wait_s`) and log
        its figures at the step they measure."""
        waiting = time.perf_counter()
        joined = self._evaluator.join() if self._evaluator is not None else None
        joined = self._processes.broadcast(joined if self._processes.is_main else None)
        if joined is not None:
            self._metrics.window.record("perf/eval_wait_s", time.perf_counter() - waiting)
            self._report_eval(*joined, trial)

    def _report_eval(self, step: int, figures: dict[str, float], trial) -> dict[str, float]:
        """Log `figures` at `step` (the base Trainer's log and on_evaluate), and track the best one
        (`metric_for_best_model`); a new best at the current step asks for its checkpoint when
        save_strategy is "best"."""
        current = self.state.global_step
        # The figures may be joined a step or more after the one they measure: log_history, metrics.jsonl
        # and report_to take the step from the state, so it reads the measured step while they log.
        self.state.global_step = step
        try:
            self.log(dict(figures))
            new_best = self._determine_best_metric(metrics=figures, trial=trial)
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, figures)
        finally:
            self.state.global_step = current
        if new_best and step == current and self.args.save_strategy == SaveStrategy.BEST:
            self.control.should_save = True
        return figures

    def _catch_up_server_weights(self) -> None:
        """The servers get the current weights if the last sync left them behind (weight_sync_steps >
        1, skipped steps): an evaluation reports the step it is logged at."""
        if self._served_step != self.state.global_step:
            self._push_weights(self.state.global_step)

    def _end_with_served_weights(self, trial) -> None:
        """With an eval dataset, train() leaves the servers running the weights it ends with (the best
        checkpoint's with load_best_model_at_end), so an evaluate() after it measures them."""
        if self._eval_rows is None:
            return
        if self.args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            self._load_best_model()
            self._push_weights(self.state.best_global_step)
        else:
            self._catch_up_server_weights()

    def _load_best_model(self) -> None:
        """Overrides Trainer's (load_best_model_at_end): the best checkpoint's weights, read from its
        shards when it is sharded (every rank)."""
        if is_sharded(self.state.best_model_checkpoint):
            load_sharded_weights(self, self.state.best_model_checkpoint, self._processes)
        else:
            super()._load_best_model()
