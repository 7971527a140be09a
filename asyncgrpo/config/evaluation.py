"""Config fields of evaluation during training that differ from training's settings. When to evaluate
is TrainingArguments' (eval_strategy, eval_steps, eval_on_start, eval_delay); the best model is
judged by an eval figure (metric_for_best_model, default reward).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EvaluationFields:
    """How an evaluation samples and scores the eval set."""

    num_generations_eval: int | None = field(
        default=None,
        metadata={
            "help": "Rollouts sampled per eval prompt, the n of pass@k (TRL's name). None: num_generations. "
            "More rollouts give a steadier pass@1 and a larger k, at that many times the eval's generation."
        },
    )
    temperature_eval: float | None = field(
        default=None,
        metadata={
            "help": "Sampling temperature of the eval rollouts (>= 0; 0: greedy decoding, as nothing "
            "sampled for evaluation is trained on). None: temperature, so the eval measures the policy "
            "training samples from."
        },
    )
    eval_pass_threshold: float = field(
        default=1.0,
        metadata={
            "help": "An eval rollout passes (pass@k) when its summed reward is at least this. 1.0: the top "
            "score of a 0/1 correctness reward, such as accuracy_reward; the highest reward a function "
            "can give is not known in general, so set it for other scales."
        },
    )

    def _resolve_evaluation(self) -> None:
        if self.num_generations_eval is None:
            self.num_generations_eval = self.num_generations
        if self.temperature_eval is None:
            self.temperature_eval = self.temperature
        if (
            self.load_best_model_at_end or self.save_strategy == "best"
        ) and self.metric_for_best_model is None:
            # TrainingArguments would pick "loss", which an RL evaluation has none of: the held-out reward
            # is what "best" means here.
            self.metric_for_best_model = "reward"

    def _validate_evaluation(self, fail) -> None:
        if self.num_generations_eval < 1:
            fail(f"num_generations_eval={self.num_generations_eval} must be >= 1 (None: num_generations)")
        if self.temperature_eval < 0:
            fail(f"temperature_eval={self.temperature_eval} must be >= 0 (0: greedy; None: temperature)")
        if self.metric_for_best_model in ("loss", "eval_loss"):
            fail(
                f"metric_for_best_model={self.metric_for_best_model!r}: an evaluation here logs no loss; use "
                "an eval figure such as 'reward' or 'pass@1' (docs/metrics.md, \"Evaluation\")"
            )
