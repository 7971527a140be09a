"""The per-run object: everything one train() call trains with and counts, created once per call.

`TrainingRun` is made by `begin_run` (trainer/run_setup.py) when train() starts and kept on the
trainer afterwards (TRL's `model_version` and an evaluate() after train() read it). It holds the
run's parts, each with explicit inputs: the processes, the prompt ledger, the step metrics, the
checkpoints, the generation session, the evaluation schedule, the rows' pass through the model and
rank 0's timeline; and the two
counters of the run: the step whose weights the servers run, and the non-finite steps in a row.
docs/architecture.md, "The trainer's modules".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from asyncgrpo.rollout.prompts import PromptOrder
from asyncgrpo.trainer.algorithm_state import AlgorithmState
from asyncgrpo.trainer.checkpoint import ResumePoint
from asyncgrpo.trainer.checkpoint_saves import RunCheckpoints
from asyncgrpo.trainer.distributed import Processes
from asyncgrpo.trainer.eval_schedule import EvaluationSchedule
from asyncgrpo.trainer.generation_session import GenerationSession
from asyncgrpo.trainer.intake import ServersLostWeights
from asyncgrpo.trainer.nonfinite import MAX_NONFINITE_STEPS, NonFiniteTrainingError
from asyncgrpo.trainer.prompt_ledger import PromptLedger
from asyncgrpo.trainer.rows_pass import RowsPass
from asyncgrpo.trainer.run_timeline import RunTimeline
from asyncgrpo.trainer.step_metrics import StepMetrics, StepResult

logger = logging.getLogger(__name__)


@dataclass
class TrainingRun:
    processes: Processes
    sharded: bool  # the model is sharded with FSDP2 (several processes, or an FSDP launch)
    ledger: PromptLedger  # which prompts are consumed: the epochs, and where a resume starts
    metrics: StepMetrics
    checkpoints: RunCheckpoints
    session: GenerationSession
    evaluations: EvaluationSchedule
    rows: RowsPass  # this process's rows of each step through the model, with the run's loss
    timeline: RunTimeline | None  # rank 0's
    served_step: int = -1  # the global step whose weights the servers run (-1: not pushed yet)
    nonfinite_streak: int = 0  # steps skipped in a row for a non-finite loss or gradient norm

    def serve_starting_weights(self, model: torch.nn.Module, step: int) -> None:
        """The servers run exactly the weights training starts from (`step`'s), as the current version."""
        self.session.sync_weights(model)
        self.served_step = step

    def push_weights(self, model: torch.nn.Module, step: int) -> None:
        """A new policy version, pushed to the servers (every process): `model`'s weights (unwrapped),
        those of global step `step`."""
        self.session.model_version += 1
        self.session.sync_weights(model)
        self.served_step = step

    def catch_up_server_weights(self, model: torch.nn.Module, step: int) -> None:
        """The servers get the weights of `step` (the current one) if the last sync left them behind
        (weight_sync_steps > 1, skipped steps): an evaluation reports the step it is logged at."""
        if self.served_step != step:
            self.push_weights(model, step)

    def restore_server_weights(self, model: torch.nn.Module, lost: ServersLostWeights, step: int) -> None:
        """Servers that lost the policy get it again, with the live ones: the model as it is now (a
        new version when the servers ran an older step's, weight_sync_steps > 1)."""
        if self.served_step != step:
            self.session.model_version += 1
            self.served_step = step
        self.session.restore_server_weights(model, lost)

    def count_step(self, result: StepResult, step: int) -> None:
        """A step's outcome for the non-finite streak: a skipped one is warned about, and
        `MAX_NONFINITE_STEPS` in a row stop the run (`step`: the global step it would have been)."""
        if result.stepped:
            self.nonfinite_streak = 0
            return
        self.nonfinite_streak += 1
        logger.warning(
            "step %d: non-finite loss (%s) or gradient norm (%s): the optimizer step and the weight "
            "sync are skipped (%d in a row)",
            step,
            result.loss,
            result.grad_norm,
            self.nonfinite_streak,
        )
        if self.nonfinite_streak >= MAX_NONFINITE_STEPS:
            raise NonFiniteTrainingError(
                f"{self.nonfinite_streak} steps in a row had a non-finite loss or gradient norm (last: "
                f"loss {result.loss}, gradient norm {result.grad_norm}); training stopped before the weights "
                "were touched. Lower learning_rate, set max_grad_norm, and look at the rewards and "
                "advantages of recent steps."
            )

    def resume_point(self, prompt_order: PromptOrder, algorithm: AlgorithmState) -> ResumePoint:
        """What a checkpoint of this run carries beyond the weights and the optimizer."""
        return ResumePoint.of_run(
            self.ledger,
            self.session.model_version,
            self.metrics.num_tokens,
            self.session.held_samples(),
            prompt_order,
            algorithm,
        )

    def close(self) -> None:
        """The end of the run, also after a failure: the save in flight lands, the evaluator closes,
        then the session shuts down what it opened and the timeline is written."""
        try:
            self.checkpoints.close()
            self.evaluations.close()
        finally:
            self.session.close()
            if self.timeline is not None:
                self.timeline.close()
