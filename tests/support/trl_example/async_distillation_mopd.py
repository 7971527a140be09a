# TRL 1.16's examples/scripts/async_distillation_mopd.py (Apache-2.0, Copyright 2020-2026 The HuggingFace
# Team), reproduced as a user would run it with asyncgrpo. Changed, and only these, each marked `# changed`:
#   - the import (trl.experimental.async_distillation -> asyncgrpo);
#   - the model and the datasets: a tiny local model and two tiny JSON files shaped as GSM8K and the code
#     instructions dataset (argv 1, 2 and 3);
#   - the servers' URLs (argv 4: the student's, 5 and 6: the math and code teachers'): the example relies
#     on ports 8000 to 8002, which a test on a shared machine cannot take;
#   - max_steps 100 -> 3, max_completion_length 256 -> 16, and report_to "trackio" -> "none" (no trackio
#     here, and it would publish to a Hugging Face Space), to keep the test short and offline.
# It is launched unchanged otherwise.

import sys  # changed: the tiny model, datasets and servers come from argv

from datasets import concatenate_datasets, load_dataset

from asyncgrpo import AsyncDistillationConfig, AsyncDistillationTrainer  # changed


def format_math(sample):
    return {"prompt": [{"role": "user", "content": sample["question"]}], "teacher_id": "math"}


def format_code(sample):
    content = sample["instruction"]
    if sample["input"].strip():
        content = f"{content}\n\n{sample['input']}"
    return {"prompt": [{"role": "user", "content": content}], "teacher_id": "code"}


def main() -> None:
    math_dataset = load_dataset("json", data_files=sys.argv[2], split="train")  # changed
    math_dataset = math_dataset.map(format_math, remove_columns=math_dataset.column_names)

    code_dataset = load_dataset("json", data_files=sys.argv[3], split="train")  # changed
    code_dataset = code_dataset.map(format_code, remove_columns=code_dataset.column_names)

    dataset = concatenate_datasets([math_dataset, code_dataset]).shuffle(seed=42)

    config = AsyncDistillationConfig(
        output_dir="async_distillation_mopd",
        save_strategy="no",
        per_device_train_batch_size=16,
        gradient_accumulation_steps=2,
        max_completion_length=16,  # changed
        beta=1.0,  # the paper's Stage 3 minimizes reverse KL against the routed teacher
        teacher_server_urls={
            "math": sys.argv[5],  # changed
            "code": sys.argv[6],  # changed
        },
        vllm_server_base_url=sys.argv[4],  # changed
        max_steps=3,  # changed
        learning_rate=1e-6,
        report_to="none",  # changed
        trackio_space_id="async-distillation-mopd",
        project="async-distillation-mopd",
        log_completions=True,
    )
    trainer = AsyncDistillationTrainer(
        model=sys.argv[1],  # changed
        args=config,
        train_dataset=dataset,
    )
    trainer.train()


if __name__ == "__main__":
    main()
