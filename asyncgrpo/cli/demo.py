"""`make demo`: a real asynchronous GRPO run on this machine, against a real vLLM CPU server.

The task a person can check: "What is a + b?" for digits a, b; the reward is 1 when the answer is
exactly the sum. The tiny model starts from random weights, so it first gets a supervised warm start,
shown as its own phase (`warm_start`): right answers until it has mostly learnt the sums, then noisy
answers until it is unsure of them, like a model that knows the task but has not been sharpened on
it; async GRPO then has to raise its accuracy. Why the noisy part: a model trained only part way on
right answers is confidently wrong on many prompts, whose groups carry no signal, and GRPO's gain
then often fell short of the bar (bench/RESULTS.md, "demo"). The vLLM server starts on the random
weights while the warm start runs; the trainer's first weight sync hands it the warm-started policy.

GRPO trains on 80 of the 100 sums and evaluates the other 20 as it goes (the held-out accuracy,
printed at the start and the end): the warm start saw every sum, as a pretrained model has seen its
task, but GRPO's sharpening reaches the 20 only if it transfers.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

import numpy as np
import torch

# The warm start (see `warm_start`): right answers until the model samples the right sum KNOWN_ACCURACY
# of the time, then noisy answers until it does only UNSURE_ACCURACY of the time.
WARM_START_LR = 3e-3
KNOWN_ACCURACY, KNOWN_MAX_STEPS = 0.7, 800
UNSURE_ACCURACY, UNSURE_MAX_STEPS = 0.3, 100
NOISY_RIGHT_FRAC, NOISY_LR = 0.25, 3e-4
GRPO_STEPS = int(os.environ.get("ASYNCGRPO_DEMO_STEPS", 120))
# Sums GRPO never trains on, drawn once with a fixed seed: a fifth of the 100, so that the held-out
# accuracy moves in steps of 1/(20 x EVAL_GENERATIONS) while the training set keeps 80 prompts.
HELD_OUT_SUMS, HELD_OUT_SEED = 20, 1234
EVAL_GENERATIONS = 8  # rollouts per held-out sum: 160 short requests, a few seconds of the CPU server
EVAL_EVERY_STEPS = 30  # four evaluations over the default 120 steps, plus the one at the start
GRPO_LR = float(os.environ.get("ASYNCGRPO_DEMO_LR", 6e-4))


def addition_prompt(a: int, b: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"What is {a} + {b}?"}]


def correct_sum(completions, answer, **kwargs) -> list[float]:
    """1.0 when the reply is exactly the sum (surrounding spaces ignored), else 0.0."""
    return [
        1.0 if completion[0]["content"].strip() == str(expected) else 0.0
        for completion, expected in zip(completions, answer)
    ]


ALL_PAIRS = [(a, b) for a in range(10) for b in range(10)]
HELD_OUT_PAIRS = sorted(random.Random(HELD_OUT_SEED).sample(ALL_PAIRS, HELD_OUT_SUMS))
TRAIN_PAIRS = [pair for pair in ALL_PAIRS if pair not in HELD_OUT_PAIRS]


def addition_dataset(pairs: list[tuple[int, int]] = ALL_PAIRS):
    """The prompts "What is a + b?" of `pairs` (every sum of two digits by default), with answers."""
    from datasets import Dataset

    return Dataset.from_dict(
        {"prompt": [addition_prompt(a, b) for a, b in pairs], "answer": [a + b for a, b in pairs]}
    )


def supervised_steps(model, draw_batch, steps: int, lr: float = WARM_START_LR) -> None:
    """`steps` AdamW steps of next-token loss on the answers only: `draw_batch()` returns a list of
    (prompt_ids, answer_ids) pairs, the prompt being context. Each batch is packed into one prefix-trie
    row as the trainer packs its samples (asyncgrpo/packing), so a prompt prefix the batch shares (a
    system prompt, the tools' schemas) is forwarded once. The warm start of the demo and of the agent
    learning test (tests/integration/test_agents_e2e.py)."""
    from asyncgrpo.losses.token_logprobs import row_logprobs
    from asyncgrpo.packing.tree_attention import enable_tree_attention
    from asyncgrpo.packing.trie import pack_row
    from asyncgrpo.records.sample import Sample

    attention = model.config._attn_implementation
    enable_tree_attention(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        samples = []
        for prompt, answer in draw_batch():
            trained = np.zeros(len(prompt) + len(answer), dtype=bool)
            trained[len(prompt) :] = True
            samples.append(
                Sample(
                    token_ids=np.asarray(prompt + answer, dtype=np.int64),
                    trained=trained,
                    sampler_logprobs=np.zeros(len(answer), dtype=np.float32),
                    advantage=0.0,
                    group_id=0,
                )
            )
        (-row_logprobs(model, pack_row(samples)).logprobs.mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    model.set_attn_implementation(attention)  # a plain forward (generation, evaluation) again


def answer_probability(model, examples: list[tuple[list[int], list[int]]]) -> float:
    """The mean probability of sampling exactly each example's answer at temperature 1."""
    with torch.no_grad():
        total = 0.0
        for prompt, answer in examples:
            logprobs = torch.log_softmax(model(input_ids=torch.tensor([prompt + answer])).logits[0], -1)
            total += float(sum(logprobs[len(prompt) - 1 + k, token] for k, token in enumerate(answer)).exp())
    return total / len(examples)


def warm_start(model, tokenizer, seed: int = 0, known_max_steps: int = KNOWN_MAX_STEPS) -> float:
    """Supervised steps in two phases; returns the expected accuracy of sampling at temperature 1
    afterwards (the mean probability of the exact answer, over all 100 prompts).

    1. Right (prompt, answer) pairs, 50 steps at a time, until that accuracy reaches KNOWN_ACCURACY
       (or after `known_max_steps`).
    2. Answers right NOISY_RIGHT_FRAC of the time (otherwise a random number 0-18), 5 steps at a time,
       until it falls to UNSURE_ACCURACY. At a tenth of the rate: a fresh optimizer's first steps move
       every weight by about the rate, and at the full rate they wipe out what phase 1 taught.
    Both phases stop on the accuracy, not after a fixed number of steps: how fast the tiny model
    learns varies from one seed to another (the same 250 steps left 0.47 to 0.71), and a fixed recipe
    left some seeds with little to sharpen and others confidently wrong on prompts GRPO then cannot
    move."""
    from asyncgrpo.rollout.chat import render_prompt_ids

    rng = random.Random(seed)
    examples = []
    for a in range(10):
        for b in range(10):
            prompt = render_prompt_ids(tokenizer, addition_prompt(a, b))
            examples.append((prompt, tokenizer.encode(str(a + b)) + [tokenizer.eos_token_id]))

    def noisy():
        batch = []
        for prompt, answer in (rng.choice(examples) for _ in range(64)):
            if rng.random() >= NOISY_RIGHT_FRAC:
                answer = tokenizer.encode(str(rng.randint(0, 18))) + [tokenizer.eos_token_id]
            batch.append((prompt, answer))
        return batch

    steps, accuracy = 0, answer_probability(model, examples)
    while accuracy < KNOWN_ACCURACY and steps < known_max_steps:
        supervised_steps(model, lambda: [rng.choice(examples) for _ in range(64)], 50)
        steps, accuracy = steps + 50, answer_probability(model, examples)
    print(f"[demo] warm start, right answers: {steps} steps, accuracy {accuracy:.0%}", flush=True)
    steps = 0
    while accuracy > UNSURE_ACCURACY and steps < UNSURE_MAX_STEPS:
        supervised_steps(model, noisy, 5, lr=NOISY_LR)
        steps, accuracy = steps + 5, answer_probability(model, examples)
    print(f"[demo] warm start, noisy answers: {steps} steps, accuracy {accuracy:.0%}", flush=True)
    return accuracy


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# What the demo must show on a 2-core machine: the reward up by GAIN_TARGET within MINUTES_LIMIT.
GAIN_TARGET = 0.3
MINUTES_LIMIT = 10.0


def run_demo(workdir: str = ".demo", seed: int = 0) -> int:
    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.cli.tiny_model import build_model, build_tokenizer, save_tiny_model
    from asyncgrpo.generation.server import ServerOptions, VLLMServer

    logging.basicConfig(level=logging.WARNING)
    # SIGTERM (a timeout, `kill`) unwinds like Ctrl-C, so the vLLM server is stopped, not orphaned.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = time.time()
    work = Path(workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    base_dir = save_tiny_model(work / "tiny-model")
    print(f"[demo] tiny Qwen3 model built in {base_dir}", flush=True)
    options = ServerOptions(
        model=str(base_dir), port=_free_port(), max_model_len=512, dtype="float32", cpu=True
    )
    server = VLLMServer(options, log_path=work / "vllm.log")
    print(f"[demo] starting vLLM on CPU at {options.url} (log: {server.log_path})", flush=True)
    server_starting = _Background(server.start)  # slow to start: overlaps the warm start

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = build_model(tokenizer)
    accuracy = warm_start(model, tokenizer, seed=seed)
    warm_dir = work / "warm-start"
    model.save_pretrained(warm_dir)
    tokenizer.save_pretrained(warm_dir)
    print(
        f"[demo] supervised warm start done: the model now samples the right sum {accuracy:.0%} of the time "
        "(temperature 1). GRPO takes it from here.",
        flush=True,
    )
    server_starting.join()
    if server_starting.error is not None:
        raise server_starting.error
    # vLLM's CPU engine keeps both cores busy while it generates; a trainer with two threads of its
    # own then stalls at every parallel region, and was several times slower than with one
    # (bench/RESULTS.md, "demo").
    torch.set_num_threads(1)
    try:
        args = AsyncGRPOConfig(
            output_dir=str(work / "grpo"),
            vllm_server_base_url=options.url,
            max_steps=GRPO_STEPS,
            num_generations=int(os.environ.get("ASYNCGRPO_DEMO_GENERATIONS", 16)),
            max_completion_length=8,
            temperature=1.0,
            learning_rate=GRPO_LR,
            lr_scheduler_type="constant_with_warmup",
            warmup_steps=5,
            token_budget=256,
            max_staleness=1,
            gradient_checkpointing=False,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            seed=seed,
            vllm_server_timeout=300,
            eval_strategy="steps",
            eval_steps=EVAL_EVERY_STEPS,
            eval_on_start=True,
            num_generations_eval=EVAL_GENERATIONS,
        )
        trainer = AsyncGRPOTrainer(
            model=str(warm_dir),
            reward_funcs=correct_sum,
            args=args,
            train_dataset=addition_dataset(TRAIN_PAIRS),
            eval_dataset=addition_dataset(HELD_OUT_PAIRS),
        )
        trainer.train()
    finally:
        server.stop()
    (work / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    return report_figures(trainer.state.log_history, minutes=(time.time() - started) / 60, seed=seed)


def report_figures(log_history: list[dict], minutes: float, seed: int) -> int:
    """Print the demo's figures from the run's log history (a run that ended before its last step, at
    a pass without signal, counts as it is) and return the exit code: 1 unless the reward rose by
    GAIN_TARGET within MINUTES_LIMIT."""
    rewards = [entry["reward"] for entry in log_history if "reward" in entry]
    # The optimizer steps taken: a step whose window held no rollout's reward yet logs none.
    steps = max((entry.get("step", 0) for entry in log_history), default=0)
    first, last = _mean(rewards[:10]), _mean(rewards[-10:])
    print(f"[demo] reward (fraction of exact sums) over the first 10 steps: {first:.3f}, last 10: {last:.3f}")
    held_out = [entry["eval_pass@1"] for entry in log_history if "eval_pass@1" in entry]
    print(
        f"[demo] held-out accuracy ({HELD_OUT_SUMS} sums GRPO never trains on, eval_pass@1): "
        f"start {held_out[0]:.3f}, end {held_out[-1]:.3f}"
    )
    print(
        f"demo reward_first10={first:.3f} reward_last10={last:.3f} held_out_start={held_out[0]:.3f} "
        f"held_out_end={held_out[-1]:.3f} steps={steps} minutes={minutes:.1f} seed={seed}"
    )
    failures = []
    if not last >= first + GAIN_TARGET:
        failures.append(
            f"the reward rose by {last - first:+.3f}, less than the +{GAIN_TARGET} the demo must show "
            f"(per-step rewards: {', '.join(f'{r:.2f}' for r in rewards)})"
        )
    if minutes > MINUTES_LIMIT:
        failures.append(f"it took {minutes:.1f} minutes, more than {MINUTES_LIMIT:g} (is the machine busy?)")
    for failure in failures:
        print(f"[demo] FAILED: {failure}", flush=True)
    return 1 if failures else 0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


class _Background:
    """Run `target` in a thread; `join()` then look at `error`."""

    def __init__(self, target):
        self.error: BaseException | None = None

        def run():
            try:
                target()
            except BaseException as error:  # re-raised by the caller after join()
                self.error = error

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join()


if __name__ == "__main__":
    raise SystemExit(
        run_demo(os.environ.get("ASYNCGRPO_DEMO_DIR", ".demo"), int(os.environ.get("ASYNCGRPO_DEMO_SEED", 0)))
    )
