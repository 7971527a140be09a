"""One process of `test_two_processes_train_against_the_server`: AsyncGRPOTrainer launched with
torchrun on two CPU processes (FSDP2 over gloo) for a few steps against a real vLLM server.
argv: server URL, model dir, output dir, max_steps[, checkpoint to resume from]; a checkpoint every
2 steps. With ASYNCGRPO_TEST_LORA=1 a LoRA adapter is trained (tests/integration/test_peft_vllm.py). With
ASYNCGRPO_TEST_TEACHER=URL the run is on-policy distillation from that teacher, with no reward
(tests/integration/test_distillation_e2e.py). With
ASYNCGRPO_TEST_EVAL=1 the run evaluates `eval_prompts()` after every step, and calls evaluate() itself
(prefix "mid") on the weights of step `MID_EVAL_STEP`. Rank 0 writes the logged history to
output_dir/history-<max_steps>.json, rank r > 0 to history-<max_steps>-rank<r>.json; `save_model` writes the
trained model (or adapter) to output_dir/model-<max_steps>."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/conftest.py's helpers

from datasets import Dataset  # noqa: E402
from worker_side import parity_or_listed_passes, prompts, token_parity_reward  # noqa: E402

# The rollout worker, a spawned process, runs this file's top level again (as `__mp_main__`): what it
# needs comes from tests/support/worker_side.py, and the trainer's imports wait in main().

# Of the 2 rollouts of each eval prompt, how many pass: the eval figures are counted by hand whatever the
# servers sample (eval_reward 3/6, pass@1 (0 + 1/2 + 1) / 3, pass@2 2/3).
EVAL_PASSES = [0, 1, 2]
MID_EVAL_STEP = 3


def eval_prompts() -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [
                [{"role": "user", "content": f"Name a colour ({i})."}] for i in range(len(EVAL_PASSES))
            ],
            "passes": EVAL_PASSES,
        }
    )


def evaluate_at_step(step: int):
    """A callback that calls trainer.evaluate() itself (its `trainer` set once the trainer exists)."""
    from transformers import TrainerCallback

    class EvaluateAtStep(TrainerCallback):
        """Calls trainer.evaluate() on every rank, as a user's callback would, on the weights of step `step`
        (as the next step begins: at a step's end, its log's flag would be reset by the evaluation's log,
        as in transformers' Trainer)."""

        def __init__(self, step: int):
            self.step = step
            self.trainer = None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == self.step:
                self.trainer.evaluate(metric_key_prefix="mid")

    return EvaluateAtStep(step)


def main() -> None:
    import torch.distributed as dist
    from conftest import make_config

    from asyncgrpo import AsyncDistillationConfig, AsyncDistillationTrainer, AsyncGRPOTrainer

    url, model_dir, output_dir, max_steps = sys.argv[1:5]
    resume = sys.argv[5] if len(sys.argv) > 5 else None
    evaluating = os.environ.get("ASYNCGRPO_TEST_EVAL") == "1"
    evaluation = dict(eval_strategy="steps", eval_steps=1, num_generations_eval=2) if evaluating else {}
    teacher = os.environ.get("ASYNCGRPO_TEST_TEACHER")
    distillation = {}
    if teacher is not None:
        distillation = dict(
            config_class=AsyncDistillationConfig,
            teacher_server_urls={"taught": teacher},
            max_completion_length=6,
        )
    config = make_config(
        SimpleNamespace(url=url), output_dir, max_steps=int(max_steps), learning_rate=1e-3, use_cpu=True,
        save_strategy="steps", save_steps=2, **evaluation, **distillation,
    )  # fmt: skip
    peft_config = None
    if os.environ.get("ASYNCGRPO_TEST_LORA") == "1":
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]
        )
        config.learning_rate = 5e-2
    reward, eval_dataset, callbacks = token_parity_reward, None, []
    if evaluating:
        reward, eval_dataset = parity_or_listed_passes, eval_prompts()
        callbacks = [evaluate_at_step(MID_EVAL_STEP)]
    if teacher is not None:  # the teacher's sums, which it answers "7"
        from asyncgrpo.cli.demo import addition_prompt

        sums = Dataset.from_dict({"prompt": [addition_prompt(a, b) for a in range(4) for b in range(4)]})
        trainer = AsyncDistillationTrainer(
            model_dir, config, train_dataset=sums, peft_config=peft_config, callbacks=callbacks
        )
    else:
        trainer = AsyncGRPOTrainer(
            model_dir,
            reward,
            config,
            train_dataset=prompts(),
            peft_config=peft_config,
            callbacks=callbacks,
            eval_dataset=eval_dataset,
        )
    for callback in callbacks:
        callback.trainer = trainer
    assert trainer.accelerator.num_processes == 2, "the trainer must see both processes"
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(str(Path(output_dir) / f"model-{max_steps}"))  # every rank, as transformers asks
    rank = dist.get_rank()
    name = f"history-{max_steps}.json" if rank == 0 else f"history-{max_steps}-rank{rank}.json"
    (Path(output_dir) / name).write_text(json.dumps(trainer.state.log_history))


if __name__ == "__main__":
    main()
