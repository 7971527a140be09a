"""The loss menu's parts that live across steps: the reference model (beta > 0), the entropy bonus's
coefficient, and what each step's rows share (`StepLoss`). The training loop calls it when the run's
model is ready (`prepare`), before a step's first row (`step_loss`, `for_row`), when the step's rows are
read (`observe`), after the optimizer step (`after_step`) and at a checkpoint (`state`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.losses import EntropyCoefficient
from asyncgrpo.losses.regularizers import entropy_threshold
from asyncgrpo.records.metrics import MetricsWindow, Reduce, Stat
from asyncgrpo.trainer.algorithm_state import AlgorithmState
from asyncgrpo.trainer.distributed import Processes, full_model_state, load_full_model_state
from asyncgrpo.trainer.intake import StepBatch
from asyncgrpo.trainer.reference_model import ReferenceModel
from asyncgrpo.trainer.row_loss import StepLoss, algorithm_settings, row_loss

# The row metric the adaptive coefficient reads: the mean entropy over the tokens the bonus acts on.
BONUS_ENTROPY_METRIC = "entropy/bonus_tokens_mean"


class LossMenu:
    def __init__(self, model: torch.nn.Module, args: AsyncGRPOConfig):
        """`model`: the policy as the trainer was built (unwrapped), whose copy is the reference."""
        self.args = args
        self.reference = ReferenceModel.for_policy(model, args)
        self.entropy = EntropyCoefficient(
            args.entropy_coef,
            adaptive=args.use_adaptive_entropy,
            target=args.entropy_target,
            delta=args.entropy_coef_delta,
            minimum=args.entropy_coef_min,
            maximum=args.entropy_coef_max,
        )
        self._prepared = False
        self._step_entropy = float("nan")  # the last step's entropy over the bonus's tokens

    def prepare(
        self,
        processes: Processes,
        sharded: bool,
        reshard: bool,
        compile_options: dict | None,
        resumed: AlgorithmState,
    ) -> None:
        """At a run's start: the reference on the device (once), and a checkpoint's state restored."""
        if self.reference is not None and not self._prepared:
            self.reference.prepare(self.args.device, sharded, reshard, compile_options)
        self._prepared = True
        self._processes, self._sharded = processes, sharded
        if resumed.entropy_coefficient is not None:
            self.entropy.load_state(resumed.entropy_coefficient)
        if resumed.reference is not None and self.reference is not None and self.reference.is_copy:
            load_full_model_state(self.reference.model, resumed.reference, sharded)

    def step_loss(self, batch: StepBatch) -> StepLoss:
        """What the step's rows share, from its plan (known on every rank)."""
        return StepLoss.of_plans(
            batch.plans,
            self._processes.world_size,
            algorithm_settings(self.args, self.entropy.applied()),
            reference=self.reference,
        )

    def for_row(self, step: StepLoss, counted: bool) -> StepLoss:
        """The step's shares for one row; with several processes and top_entropy_quantile < 1, the
        micro-batch's entropy threshold is found over every process's row (a collective each row:
        every rank calls it, a rank whose row is borrowed and not `counted` brings no entropies)."""
        if not self._processes.distributed or self.args.top_entropy_quantile >= 1.0:
            return step
        threshold = self._threshold_over_processes(counted)
        return dataclasses.replace(step, micro_batch_entropy_threshold=threshold)

    def row_loss(
        self, model, row, entries_global: float, step: StepLoss, keep_logits: bool, policy_version: int
    ) -> tuple[torch.Tensor, dict[str, Stat]]:
        """One packed row's loss and metrics (trainer/row_loss.py): the micro-batch's trained tokens
        over every process are `entries_global`."""
        return row_loss(model, row, entries_global, self.args, step, keep_logits, policy_version)

    def _threshold_over_processes(self, counted: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        def threshold(entropy: torch.Tensor) -> torch.Tensor:
            local = entropy.detach().float().cpu() if counted else torch.empty(0)
            return entropy_threshold(torch.cat(self._processes.gather(local)), self.args.top_entropy_quantile)

        return threshold

    def observe(self, row_stats: list[dict[str, Stat]]) -> None:
        """The step's rows' metrics (every row of every process, read on the host)."""
        measured = [stats[BONUS_ENTROPY_METRIC] for stats in row_stats if BONUS_ENTROPY_METRIC in stats]
        weight = sum(stat.weight for stat in measured)
        self._step_entropy = sum(stat.value for stat in measured) / weight if weight else float("nan")

    def after_step(self, window: MetricsWindow, policy: torch.nn.Module, step: int) -> None:
        """After the optimizer step `step` (1-based), on every rank: the coefficient's update and
        metric, the per-step totals counted once, the TR-DPO reference update."""
        if self.entropy.enabled:
            window.add("policy_loss", Stat(Reduce.MEAN, 0.0, 1.0))  # the step's weight (rows add 0)
            self.entropy.update(self._step_entropy)
            window.record("entropy_coef", self.entropy.coefficient)  # as TRL: the next step's, once updated
        args = self.args
        if args.sync_ref_model and step % args.ref_model_sync_steps == 0:
            self.reference.sync(policy, args.ref_model_mixup_alpha)

    def state(self) -> AlgorithmState:
        """What a checkpoint keeps (a collective with a sharded synced reference: every rank calls it)."""
        reference = None
        if self.args.sync_ref_model and self.reference is not None:
            reference = full_model_state(self.reference.model, self._sharded)
        entropy = self.entropy.state() if self.args.use_adaptive_entropy else None
        return AlgorithmState(entropy, reference)
