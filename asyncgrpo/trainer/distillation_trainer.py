"""AsyncDistillationTrainer: on-policy distillation on AsyncGRPOTrainer's pipeline (TRL 1.16's API).

The student samples from its vLLM server as in GRPO; the rollout worker's scoring step sends each
sample to its teacher (rollout/teacher.py) instead of needing a reward; the loss is the generalized JSD
to the teacher (trainer/distillation_loss.py). Everything else (the spawned worker, the token allowance,
tree packing, weight sync to the student's server, checkpoints and exact resume, metrics, the timeline,
LoRA, FSDP2) is the GRPO trainer's own, unchanged: this class only swaps the loss and says no reward is
needed. docs/distillation.md.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel

from asyncgrpo.config import AsyncDistillationConfig
from asyncgrpo.trainer.async_grpo_trainer import AsyncGRPOTrainer
from asyncgrpo.trainer.distillation_loss import DistillationLoss


class AsyncDistillationTrainer(AsyncGRPOTrainer):
    """On-policy distillation (TRL 1.16's `AsyncDistillationTrainer`, its arguments in its order): the
    student `model` samples, the teachers of `args.teacher_server_urls` score every sampled token, and
    the student minimises the generalized JSD to them. No reward function. `eval_dataset` is not
    supported yet."""

    _tag_names = ["trl", "async-distillation", "asyncgrpo"]
    _signal_without_rewards = True

    def __init__(
        self,
        model: str | PreTrainedModel,
        args: AsyncDistillationConfig | None = None,
        train_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        rollout_worker=None,
        weight_transfer=None,
    ):
        model_id = model if isinstance(model, str) else model.config._name_or_path
        if args is None:
            args = AsyncDistillationConfig(output_dir=f"{Path(model_id).name or 'model'}-AsyncDistillation")
        if not isinstance(args, AsyncDistillationConfig):
            raise TypeError(
                "AsyncDistillationTrainer needs an AsyncDistillationConfig (its teachers and the "
                f"divergence's settings), got {type(args).__name__}"
            )
        super().__init__(
            model,
            reward_funcs=None,
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            rollout_worker=rollout_worker,
            weight_transfer=weight_transfer,
        )

    def _make_loss(self, model: PreTrainedModel, args: AsyncDistillationConfig) -> DistillationLoss:
        return DistillationLoss(args)
