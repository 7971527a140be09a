"""One process of `test_two_processes_train_against_the_server`: AsyncGRPOTrainer launched with
torchrun on two CPU processes (FSDP2 over gloo) for a few steps against a real vLLM server.
argv: server URL, model dir, output dir, max_steps[, checkpoint to resume from]; a checkpoint every
2 steps. With ASYNCGRPO_TEST_LORA=1 a LoRA adapter is trained (tests/test_peft_vllm.py). Rank 0
writes the logged history to output_dir/history-<max_steps>.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import make_config  # noqa: E402
from test_trainer_e2e import prompts, token_parity_reward  # noqa: E402

from asyncgrpo import AsyncGRPOTrainer  # noqa: E402


def main() -> None:
    url, model_dir, output_dir, max_steps = sys.argv[1:5]
    resume = sys.argv[5] if len(sys.argv) > 5 else None
    config = make_config(
        SimpleNamespace(url=url), output_dir, max_steps=int(max_steps), learning_rate=1e-3, use_cpu=True,
        save_strategy="steps", save_steps=2,
    )  # fmt: skip
    peft_config = None
    if os.environ.get("ASYNCGRPO_TEST_LORA") == "1":
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]
        )
        config.learning_rate = 5e-2
    trainer = AsyncGRPOTrainer(
        model_dir, token_parity_reward, config, train_dataset=prompts(), peft_config=peft_config
    )
    assert trainer.accelerator.num_processes == 2, "the trainer must see both processes"
    trainer.train(resume_from_checkpoint=resume)
    if dist.get_rank() == 0:
        (Path(output_dir) / f"history-{max_steps}.json").write_text(json.dumps(trainer.state.log_history))


if __name__ == "__main__":
    main()
