"""On-policy distillation of the tiny model on CPU: steps for the student's divergence to halve, and the
teacher's scoring throughput next to the student's generation.

Two real vLLM CPU servers: the student's (the tiny model, its weights synced every step) and the
teacher's (the tiny model taught by 8 supervised steps to answer "7" to every "What is a + b?", as
tests/integration/test_distillation_e2e.py teaches it). AsyncDistillationTrainer then distills the student for
`--steps` steps with no reward. Printed: `jsd` of every step; `halved_at_step`, the first step whose
`jsd` is at most half the mean of the first two; the student's generated tokens/s
(`rollout/generated_tokens_per_s`, mean over steps), the tokens the teacher scored per second of the
run, and the share of a group's scoring time spent waiting for the teacher. `--baseline` runs the same
steps as GRPO on the student's server alone, with a random reward in place of the teacher (no group is
dropped, so every step trains as many tokens): its generated tokens/s and run time are what the teacher
is measured against. `--teacher-cost` measures the teacher's cost alone: the same GRPO run (random reward,
the same completion lengths) twice, without a teacher and with one whose term is too small to change
what is learned (`teacher_kl_coef=1e-3`, every token scored), and prints the second's throughput as a
fraction of the first's, against the target (at least 0.5: the teacher must not halve it). Run under
the machine's heavy-job lock:
`.venv/bin/python bench/distillation.py [--steps 30] [--baseline | --teacher-cost]`.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def random_reward(completions, **kwargs) -> list[float]:
    """The baseline's reward: noise, so that no group is dropped for equal rewards."""
    import random

    return [random.random() for _ in completions]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncgrpo import AsyncDistillationConfig, AsyncDistillationTrainer, AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.cli.demo import addition_prompt, answer_probability, supervised_steps
    from asyncgrpo.cli.tiny_model import save_tiny_model
    from asyncgrpo.generation.server import ServerOptions, VLLMServer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--completion-tokens", type=int, default=32)
    parser.add_argument("--baseline", action="store_true", help="GRPO with a random reward, no teacher")
    parser.add_argument(
        "--teacher-cost", action="store_true", help="GRPO with a random reward, without and with a teacher"
    )
    options = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="asyncgrpo-distillation-"))
    student_dir = save_tiny_model(work / "student")
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    teacher = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    prompts = [addition_prompt(a, b) for a in range(10) for b in range(10)]
    answer = tokenizer.encode("7", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    examples = [
        (
            tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False),
            answer,
        )
        for p in prompts
    ]
    rng = np.random.default_rng(0)
    supervised_steps(teacher, lambda: [examples[i] for i in rng.choice(len(examples), 8)], 8, 3e-3)
    teacher_dir = work / "teacher"
    teacher.save_pretrained(teacher_dir, safe_serialization=True)
    tokenizer.save_pretrained(teacher_dir)
    print(f"[distillation] teacher P(answer)={answer_probability(teacher, examples):.4f}", flush=True)

    servers = [
        VLLMServer(
            ServerOptions(model=str(model), port=free_port(), max_model_len=1024, dtype="float32", cpu=True),
            log_path=work / f"{name}.log",
        )
        for name, model in [("student", student_dir)]
        + ([] if options.baseline else [("teacher", teacher_dir)])
    ]
    if options.teacher_cost:
        try:
            for server in servers:
                server.launch()
            for server in servers:
                server.wait_ready()
            return teacher_cost(options, work, student_dir, servers, prompts)
        finally:
            for server in servers:
                server.stop()
    for server in servers:
        server.launch()
    try:
        for server in servers:
            server.wait_ready()
        student_server = servers[0]
        settings = dict(
            output_dir=str(work / "run"),
            vllm_server_base_url=student_server.options.url,
            num_generations=4,
            max_completion_length=options.completion_tokens,
            token_budget=512,
            max_steps=options.steps,
            learning_rate=2e-3,
            gradient_checkpointing=False,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,
        )
        dataset = Dataset.from_dict({"prompt": prompts})
        if options.baseline:
            trainer = AsyncGRPOTrainer(
                str(student_dir), random_reward, args=AsyncGRPOConfig(**settings), train_dataset=dataset
            )
        else:
            config = AsyncDistillationConfig(
                teacher_server_urls={"default": servers[1].options.url}, **settings
            )
            trainer = AsyncDistillationTrainer(str(student_dir), args=config, train_dataset=dataset)
        before = answer_probability(trainer.model, examples)
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
        after = answer_probability(trainer.model, examples)
    finally:
        for server in servers:
            server.stop()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]
    generated = statistics.mean(
        e["rollout/generated_tokens_per_s"] for e in logs if "rollout/generated_tokens_per_s" in e
    )
    timings = " ".join(
        f"{name.split('/')[-1]}={statistics.mean(e[name] for e in logs if name in e):.3f}"
        for name in ("perf/step_s", "perf/rollout_wait_s", "rollout/duration_s", "rollout/score_s")
        if any(name in e for e in logs)
    )
    completion = statistics.mean(e["completions/mean_length"] for e in logs if "completions/mean_length" in e)
    print(f"[distillation] means over steps: {timings} completion_tokens={completion:.1f}")
    if options.baseline:
        print(
            f"distillation_baseline steps={len(logs)} student_generated_tok_s={generated:.0f} "
            f"run_s={seconds:.0f} load={os.getloadavg()[0]:.1f}"
        )
        return 0
    jsd = [entry["jsd"] for entry in logs]
    start = statistics.mean(jsd[:2])
    halved = next((step for step, value in enumerate(jsd, 1) if value <= start / 2), None)
    generated = statistics.mean(
        e["rollout/generated_tokens_per_s"] for e in logs if "rollout/generated_tokens_per_s" in e
    )
    scored = sum(e.get("rollout/teacher_scored_tokens", 0.0) for e in logs)
    teacher_s = statistics.mean(e["rollout/teacher_score_s"] for e in logs if "rollout/teacher_score_s" in e)
    score_s = statistics.mean(e["rollout/score_s"] for e in logs if "rollout/score_s" in e)
    print("[distillation] jsd by step: " + " ".join(f"{value:.3f}" for value in jsd))
    print(
        f"distillation steps={len(jsd)} jsd_start={start:.3f} jsd_last={jsd[-1]:.4f} halved_at_step={halved} "
        f"p_answer_before={before:.2e} p_answer_after={after:.4f} student_generated_tok_s={generated:.0f} "
        f"teacher_scored_tok_s={scored / seconds:.0f} "
        f"teacher_share_of_scoring={teacher_s / max(score_s, 1e-9):.2f} "
        f"run_s={seconds:.0f} load={os.getloadavg()[0]:.1f}"
    )
    return 0


def teacher_cost(options, work: Path, student_dir: Path, servers, prompts) -> int:
    """The same GRPO run without and with a teacher scoring every token; prints the throughput ratio."""
    import asyncio

    from datasets import Dataset

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.generation.client import VLLMClient, policy_label

    async def restore_student() -> None:  # the second run starts from the same weights as the first
        async with VLLMClient(servers[0].options.url, timeout=120) as client:
            await client.reload_weights(str(student_dir), version=policy_label(0))
            await client.reset_prefix_cache()

    figures = {}
    for label, teacher in [("without", {}), ("with", dict(teacher_kl_coef=1e-3))]:
        if teacher:
            teacher["teacher_server_urls"] = {"default": servers[1].options.url}
        asyncio.run(restore_student())
        config = AsyncGRPOConfig(
            output_dir=str(work / f"run-{label}"), vllm_server_base_url=servers[0].options.url,
            num_generations=4, max_completion_length=options.completion_tokens, token_budget=512,
            max_steps=options.steps, learning_rate=2e-3, gradient_checkpointing=False, save_strategy="no",
            report_to="none", disable_tqdm=True, seed=0, **teacher,
        )  # fmt: skip
        trainer = AsyncGRPOTrainer(
            str(student_dir), random_reward, args=config, train_dataset=Dataset.from_dict({"prompt": prompts})
        )
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
        logs = [e for e in trainer.state.log_history if "loss" in e and "train_runtime" not in e]
        forwarded = max(e.get("num_tokens", 0.0) for e in logs)  # cumulative: the trainer's tokens
        lengths = statistics.mean(
            e["completions/mean_length"] for e in logs if "completions/mean_length" in e
        )
        figures[label] = (seconds, forwarded / seconds, lengths)
        print(
            f"[distillation] {label} a teacher: run_s={seconds:.1f} "
            f"forwarded_tok_s={forwarded / seconds:.0f} completion_tokens={lengths:.1f} "
            f"load={os.getloadavg()[0]:.1f}",
            flush=True,
        )
    # The headline: steps per second (each step trains one token_budget); tokens per second beside it.
    ratio = figures["without"][0] / figures["with"][0]
    tokens_ratio = figures["with"][1] / figures["without"][1]
    print(
        f"distillation_teacher_cost steps={options.steps} run_s_without={figures['without'][0]:.1f} "
        f"run_s_with={figures['with'][0]:.1f} forwarded_tok_s_ratio={tokens_ratio:.2f} "
        f"throughput_with_over_without={ratio:.2f} (target >= 0.50)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
