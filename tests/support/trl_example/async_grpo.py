# TRL 1.16's examples/scripts/async_grpo.py (Apache-2.0, Copyright 2020-2026 The HuggingFace Team),
# reproduced as a user would run it with asyncgrpo. Changed, and only these, each marked `# changed`:
#   - the two imports (trl.experimental.async_grpo -> asyncgrpo, trl.rewards -> asyncgrpo.rewards);
#   - the model and the dataset: a tiny local model and a tiny GSM8K-shaped JSON file (argv 1 and 2);
#   - the server URL (argv 3): the example relies on the default http://localhost:8000, which a test on a
#     shared machine cannot take;
#   - max_steps 200 -> 3, and report_to "trackio" -> "none" (no trackio here, and it would publish to a
#     Hugging Face Space), to keep the test short and offline.
# It is launched unchanged otherwise, with `python` or `accelerate launch`.

import sys  # changed: the tiny model, dataset and server come from argv

from datasets import load_dataset

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer  # changed
from asyncgrpo.rewards import accuracy_reward  # changed


def format_sample(sample):
    return {
        "prompt": [{"role": "user", "content": sample["question"]}],
        "solution": sample["answer"].split("####")[-1].strip(),
    }


def main() -> None:
    dataset = load_dataset("json", data_files=sys.argv[2], split="train")  # changed
    dataset = dataset.map(format_sample, remove_columns=dataset.column_names)

    config = AsyncGRPOConfig(
        output_dir="async_grpo_gsm8k",
        save_strategy="no",
        per_device_train_batch_size=16,
        gradient_accumulation_steps=2,
        max_completion_length=1024,
        chat_template_kwargs={"enable_thinking": False},
        max_steps=3,  # changed
        learning_rate=1e-5,
        report_to="none",  # changed
        trackio_space_id="async-grpo-gsm8k",
        project="async-grpo-gsm8k",
        log_completions=True,
        vllm_server_base_url=sys.argv[3],  # changed
    )
    trainer = AsyncGRPOTrainer(
        model=sys.argv[1],  # changed
        args=config,
        train_dataset=dataset,
        reward_funcs=accuracy_reward,
    )
    trainer.train()


if __name__ == "__main__":
    main()
