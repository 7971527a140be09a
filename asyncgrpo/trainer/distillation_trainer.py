"""AsyncDistillationTrainer: on-policy distillation on AsyncGRPOTrainer's pipeline (TRL 1.16's API).

The student samples from its vLLM server as in GRPO; the rollout worker's scoring step sends each
sample to its teacher (rollout/teacher.py) instead of needing a reward; the loss is the generalized JSD
to the teacher (trainer/distillation_loss.py). Everything else (the spawned worker, the token allowance,
tree packing, weight sync to the student's server, checkpoints and exact resume, metrics, the timeline,
LoRA, FSDP2) is the GRPO trainer's own, unchanged: this class only swaps the loss and says no reward is
needed. docs/distillation.md.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from transformers import PreTrainedModel

from asyncgrpo.config import AsyncDistillationConfig
from asyncgrpo.generation.teacher_client import TeacherClient
from asyncgrpo.trainer.async_grpo_trainer import AsyncGRPOTrainer
from asyncgrpo.trainer.distillation_loss import DistillationLoss

# Text whose tokens tell tokenizers apart: words, digits, punctuation, whitespace runs, accents, CJK,
# an emoji, and the chat template's special tokens.
TOKENIZER_PROBE = (
    "The quick brown fox: 12345 + 678 = 13023?\n\n\tdef f(x):  return x**2  # ok\n"
    "\u00c9lan vital, na\u00efve caf\u00e9; \u6771\u4eac \u306e \u5929\u6c17 \U0001f642 "
    "<|im_start|>user\nhi<|im_end|>"
)


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
        check_teacher_tokenizers(self.processing_class, model_id, args)

    def _make_loss(self, model: PreTrainedModel, args: AsyncDistillationConfig) -> DistillationLoss:
        return DistillationLoss(args)


def check_teacher_tokenizers(tokenizer, student: str, args: AsyncDistillationConfig) -> None:
    """Refuse a teacher whose tokenizer is not the student's, naming both: samples travel to it as
    token ids and its report indexes the student's vocabulary, so another tokenizer would train the
    student on the wrong tokens without any error. Compared on `TOKENIZER_PROBE`; each teacher is
    waited for up to vllm_server_timeout."""
    expected = tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    for teacher_id, url in args.teacher_server_urls.items():
        model, tokens = _on_fresh_loop(_teacher_tokens(url, args.vllm_server_timeout))
        if tokens != expected:
            first = next(
                (i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b),
                min(len(tokens), len(expected)),
            )
            raise ValueError(
                f"teacher {teacher_id!r} at {url} serves {model}, whose tokenizer is not the student's "
                f"({student}): the same text gives {len(tokens)} tokens there and {len(expected)} here, "
                f"first differing at token {first}. A teacher must share the student's tokenizer (samples "
                "reach it as token ids, and its scores index the student's vocabulary)."
            )


async def _teacher_tokens(url: str, timeout: float) -> tuple[str, list[int]]:
    async with TeacherClient(url, timeout=timeout) as client:
        await client.wait_until_ready()
        return await client.model_name(), await client.tokenize(TOKENIZER_PROBE)


def _on_fresh_loop(coroutine):
    """Run `coroutine` to its end on a new event loop in a thread of its own: the trainer may be built
    where a loop already runs (a notebook)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
