"""AsyncDistillationTrainer: on-policy distillation on AsyncGRPOTrainer's pipeline (TRL 1.16's API).

The student samples from its vLLM server as in GRPO; the rollout worker's scoring step sends each
sample to its teacher (rollout/teacher.py) instead of needing a reward; the loss is the generalized JSD
to the teacher (trainer/distillation_loss.py). Everything else (the spawned worker, the token allowance,
tree packing, weight sync to the student's server, checkpoints and exact resume, metrics, the timeline,
LoRA, FSDP2) is the GRPO trainer's own, unchanged: this class only swaps the loss and says no reward is
needed. docs/distillation.md.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from asyncgrpo.config import AsyncDistillationConfig
from asyncgrpo.trainer.async_grpo_trainer import AsyncGRPOTrainer
from asyncgrpo.trainer.distillation_loss import DistillationLoss


class AsyncDistillationTrainer(AsyncGRPOTrainer):
    """On-policy distillation (TRL 1.16's `AsyncDistillationTrainer`, its arguments in its order): the
    student `model` samples, the teachers of `args.teacher_server_urls` score every sampled token, and
    the student minimises the generalized JSD to them. No reward function. `eval_dataset` (by name,
    after TRL's arguments, which include none) evaluates as in AsyncGRPOTrainer: the teachers score
    the eval completions (`eval_teacher_kl`, `eval_teacher_logprob`; docs/distillation.md,
    "Evaluation")."""

    # What a second trainer supplies (docs/architecture.md, "A second trainer"): its config, its loss
    # (`_make_loss`), and that its signal needs no reward function. The per-sample scoring is the
    # rollout worker's teacher step, which the config's teacher_server_urls turn on.
    _tag_names = ["trl", "async-distillation", "asyncgrpo"]
    _signal_without_rewards = True
    config_class = AsyncDistillationConfig  # its teachers and the divergence's settings

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
        *,
        eval_dataset=None,
    ):
        # TRL's order has no reward_funcs: the base trainer's positional order, with none.
        trl_order = (model, None, args, train_dataset, processing_class, callbacks, optimizers, peft_config)
        super().__init__(
            *trl_order,
            rollout_worker=rollout_worker,
            weight_transfer=weight_transfer,
            eval_dataset=eval_dataset,
        )

    def _make_loss(self, model: PreTrainedModel, args: AsyncDistillationConfig) -> DistillationLoss:
        return DistillationLoss(args)
