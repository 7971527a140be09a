"""AsyncDistillationConfig: AsyncGRPOConfig's pipeline fields plus TRL 1.16's on-policy distillation fields.

TRL's `AsyncDistillationConfig` mirrors its `AsyncGRPOConfig` (the same pipeline, server and logging
fields) with GRPO's loss fields replaced by the teacher's; here it is a subclass of ours, so every
pipeline setting means what it means for GRPO, and the teacher's fields keep TRL's names, defaults
and meaning. Two fields change meaning or default: `beta` is the divergence's interpolation (not a KL
coefficient: distillation keeps no reference model) and `num_generations` is 1 (TRL scores one
completion per dataset row). docs/distillation.md explains the loss and the teachers' servers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncgrpo.config.async_grpo_config import AsyncGRPOConfig
from asyncgrpo.config.trl_compat import warn_once
from asyncgrpo.errors import ConfigurationError

# TRL 1.16's default teacher when teacher_server_urls is None.
DEFAULT_TEACHER_URL = "http://localhost:8001"


@dataclass
class AsyncDistillationConfig(AsyncGRPOConfig):
    """Settings of AsyncDistillationTrainer: AsyncGRPOConfig's pipeline plus the teacher's fields.

    Field names and defaults are TRL 1.16's; docs/distillation.md explains each teacher field.
    """

    num_generations: int = field(
        default=1,
        metadata={
            "help": "Completions sampled per prompt; >= 1. 1: TRL's distillation scores one completion per "
            "dataset row; more share the prompt's forward in a packed row (no group baseline is needed)."
        },
    )
    score_centering: bool | None = field(
        default=False,
        metadata={
            "help": "Unused by the distillation loss; False: the servers are asked for no sampler top "
            "log-probs, which only GRPO's score-centered loss reads."
        },
    )
    beta: float = field(
        default=0.0,
        metadata={
            "help": "Interpolation of the generalized Jensen-Shannon divergence, a fraction in [0, 1]: 0.0 "
            "is forward KL(teacher || student) over the teacher's top-k support, 1.0 reverse KL over the "
            "realized token, values between the mixture over the teacher's top-1 and the realized token "
            "(TRL 1.16's supports). 0.0: TRL's default."
        },
    )
    add_tail_bucket: bool = field(
        default=True,
        metadata={
            "help": "Add a bucket holding the probability mass outside the support on both sides, so a "
            "small support cannot make the divergence trivially small. True: TRL's default."
        },
    )
    log_completions_steps: int = field(
        default=100,
        metadata={
            "help": "Accepted for TRL scripts; no effect here (warns when changed): completions are logged "
            "at each logging step, log_completions' schedule. 100 (samples): TRL's default, i.e. unset."
        },
    )

    # No GRPO group: one rollout per prompt is a whole sample (config/generation.py reads it).
    _group_needs_advantage = False

    def __post_init__(self) -> None:
        if self.teacher_server_urls is None:  # TRL's default teacher
            self.teacher_server_urls = {"default": DEFAULT_TEACHER_URL}
        super().__post_init__()

    def _resolve_evaluation(self) -> None:
        """The best model is the one closest to its teachers: distillation's evaluation logs no reward,
        so "best" defaults to the lowest `eval_teacher_kl`."""
        if (
            self.load_best_model_at_end or self.save_strategy == "best"
        ) and self.metric_for_best_model is None:
            self.metric_for_best_model = "teacher_kl"
            if self.greater_is_better is None:
                self.greater_is_better = False
        super()._resolve_evaluation()

    def _validate_evaluation(self, fail) -> None:
        super()._validate_evaluation(fail)
        figure = (self.metric_for_best_model or "").removeprefix("eval_")
        if figure.startswith(("reward", "pass@")):
            fail(
                f"metric_for_best_model={self.metric_for_best_model!r}: a distillation run has no reward, so "
                "its evaluation logs no reward or pass@k; use 'teacher_kl' with greater_is_better=False "
                '(docs/distillation.md, "Evaluation")'
            )

    def _validate(self) -> None:
        super()._validate()

        def fail(message: str) -> None:
            raise ConfigurationError(f"AsyncDistillationConfig: {message}")

        if not 0.0 <= self.beta <= 1.0:
            fail(f"beta={self.beta} must be in [0, 1] (0: forward KL, 1: reverse KL)")
        if self.beta == 1.0 and not self.add_tail_bucket:
            fail(
                "beta=1.0 with add_tail_bucket=False: reverse KL runs over the realized token alone, "
                "which renormalized is probability 1 on both sides, so the divergence is 0 and nothing "
                "trains; keep add_tail_bucket=True or lower beta"
            )
        if self.log_completions_steps != 100:
            warn_once(
                "log_completions_steps",
                f"log_completions_steps={self.log_completions_steps} has no effect in asyncgrpo: completions "
                "are logged at each logging step when log_completions=True",
            )

    def _validate_teacher(self, fail) -> None:
        """Distillation trains on its teachers alone: GRPO's teacher term has nothing to add to."""
        self._validate_teacher_scoring(fail)
        if self.teacher_kl_coef != 0:
            fail(
                f"teacher_kl_coef={self.teacher_kl_coef}: the teacher term is GRPO's (AsyncGRPOConfig); "
                "distillation trains on the teacher alone"
            )

    def _validate_reference(self, fail) -> None:
        """`beta` here is the divergence's interpolation: distillation keeps no reference model."""
        if self.sync_ref_model:
            fail("sync_ref_model=True: distillation keeps no reference model to update (beta is the JSD's)")
