"""Does it learn as well, and how much faster? asyncgrpo against TRL's GRPOTrainer on the demo task.

The task of `make demo`: "What is a + b?" for digits a, b, reward 1 for the exact sum, on the tiny
model after the demo's supervised warm start (it samples the right sum about a quarter of the time).
Every arm starts from that same model and sees the same number of prompts, each with the same group
size, learning rate, schedule, completion length and temperature:

- `asyncgrpo`: the default (score-centered loss), against the real vLLM CPU server;
- `asyncgrpo_no_centering`: `score_centering=False` (the clipped objective);
- `asyncgrpo_sync`: a synchronous schedule, `max_staleness=0` and the server paused while the trainer
  trains (bench/overlap.py's SynchronousTrainer), so generation and training alternate;
- `trl`: TRL's own `GRPOTrainer` (the pinned release below, installed into this interpreter's
  environment by this script when missing; it is no dependency of asyncgrpo), generating with
  transformers in the training process (no vLLM), with as many samples per optimizer step as the
  default arm took on average.

A second task, `long`, is one where generation matters: completions of 48-64 tokens, from the tiny
model as built (random weights), rewarded by the share of even token ids over the whole completion
(a completion shorter than 48 tokens counts its missing tokens as odd), so every token counts and
generating is most of a synchronous step, as in real RL. Its start is the start model's mean reward,
estimated from sampled completions. Rows hold 2,048 tokens there (a group of 16 completions is about
1,100 tokens).

Reward is the mean reward of the completions each logged step generated (both trainers log it as
`reward`), recorded against optimizer steps and against wall-clock time from the start of training.
The start is the warm-started model's exact expected accuracy; "steps/minutes to +d" is the first
logged step where the mean of the last 10 logged rewards reaches start + d.
Machine notes: the vLLM server and the asyncgrpo trainer share the CPU cores (trainer: one torch
thread, as in the demo); TRL has no server and gets the torch threads it wants.
Run: `.venv/bin/python bench/learning.py [--quick] [--seeds N] [--prompts P] [--arms a,b] [--out DIR]`.
`--tasks demo,long` (the default) runs both tasks; each prints its line:
`learning minutes_to_plus_0.3 asyncgrpo=X trl=Y` and `learning_long minutes_to_plus_0.3 asyncgrpo=X trl=Y`
(the median over the seeds, a seed that never reached +0.3 counting as infinitely slow). Each run's
line gives the load average at its end and, for asyncgrpo, the share of its step that is fixed cost.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = ("asyncgrpo", "asyncgrpo_no_centering", "asyncgrpo_sync", "trl")
TRL_VERSION = "1.16.0"
GROUP_SIZE = 16
LEARNING_RATE = 6e-4
WARMUP_STEPS = 5
MAX_COMPLETION_LENGTH = 8
TOKEN_BUDGET = 256
DATASET_SIZE = 100  # the demo's prompts: every (a, b) of digits
SMOOTHING = 10  # logged steps in the moving mean the thresholds are read on
# What each asyncgrpo log carries besides the reward: the samples TRL is matched to, and where the
# step's time goes (docs/metrics.md), for the fixed-cost share the long task is judged on.
LOGGED_EXTRAS = (
    "batch/samples_per_step",
    "perf/step_s",
    "perf/fixed_cost_s",
    "perf/overlap_efficiency",
    "perf/trainer_idle_frac",
    "perf/generation_idle_frac",
    "perf/sync_pause_s",
)
GAINS = (0.2, 0.3)
HERE = Path(__file__).resolve().parent
TASKS = ("demo", "long")
LONG_MIN_TOKENS = 48
LONG_MAX_TOKENS = 64
LONG_TOKEN_BUDGET = 2048
LONG_START_SAMPLES = (
    64  # completions sampled to estimate the long task's start (4 groups: about 0.01 of spread)
)


def even_token_share(completion_ids, **kwargs) -> list[float]:
    """The long task's reward: even token ids over max(completion length, LONG_MIN_TOKENS)."""
    return [
        sum(1 for token in ids if token % 2 == 0) / max(len(ids), LONG_MIN_TOKENS) for ids in completion_ids
    ]


def long_dataset():
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "prompt": [
                [{"role": "user", "content": f"Write a long story about {i}."}] for i in range(DATASET_SIZE)
            ]
        }
    )


def task_setup(task: str):
    """(dataset, reward function, max_completion_length, token_budget) of a task."""
    if task == "long":
        return long_dataset(), even_token_share, LONG_MAX_TOKENS, LONG_TOKEN_BUDGET
    from asyncgrpo.cli.demo import addition_dataset, correct_sum

    return addition_dataset(), correct_sum, MAX_COMPLETION_LENGTH, TOKEN_BUDGET


def ensure_trl() -> None:
    """Install the pinned TRL into this environment when another (or none) is there. Its
    requirements are already met by asyncgrpo's, so nothing else changes."""
    try:
        if importlib.metadata.version("trl") == TRL_VERSION:
            return
    except importlib.metadata.PackageNotFoundError:
        pass
    print(f"[learning] installing trl=={TRL_VERSION} into {sys.prefix} (benchmark only)", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", f"trl=={TRL_VERSION}"], check=True)


# -- one run (a child process: each arm starts from a clean interpreter) ------------------------------


class RewardLog:
    """(step, seconds since training began, reward) at every log that carries a reward; with
    `stop_level`, training stops at the first log where the moving mean reaches it (`--stop-at-gain`)."""

    def __init__(self, stop_level: float | None = None):
        from transformers import TrainerCallback

        records = self.records = []
        started = [0.0]

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                started[0] = time.time()

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "reward" in logs:
                    extra = {key: logs[key] for key in LOGGED_EXTRAS if key in logs}
                    records.append({"step": state.global_step, "seconds": time.time() - started[0],
                                    "reward": float(logs["reward"]), **extra})  # fmt: skip
                    if stop_level is not None and threshold(records, stop_level) is not None:
                        control.should_training_stop = True

        self.callback = Callback()


def run_asyncgrpo(
    task: str,
    arm: str,
    seed: int,
    model_dir: str,
    url: str,
    prompts: int,
    out: Path,
    stop_level: float | None,
) -> list[dict]:
    import torch

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer

    sys.path.insert(0, str(HERE))
    from overlap import SynchronousTrainer

    torch.set_num_threads(1)  # the server generates on the same cores (asyncgrpo/cli/demo.py says why)
    dataset, reward, completion_length, token_budget = task_setup(task)
    args = AsyncGRPOConfig(
        output_dir=str(out / f"{run_name(task, arm, seed)}"),
        vllm_server_base_url=url,
        num_train_epochs=prompts / DATASET_SIZE,  # epochs count prompts consumed
        num_generations=GROUP_SIZE,
        max_completion_length=completion_length,
        temperature=1.0,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=WARMUP_STEPS,
        token_budget=token_budget,
        max_staleness=0 if arm == "asyncgrpo_sync" else 1,  # the demo's 1
        score_centering=arm != "asyncgrpo_no_centering",
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=seed,
        vllm_server_timeout=300,
    )
    trainer_class = SynchronousTrainer if arm == "asyncgrpo_sync" else AsyncGRPOTrainer
    log = RewardLog(stop_level)
    trainer = trainer_class(model_dir, reward, args, train_dataset=dataset, callbacks=[log.callback])
    trainer.train()
    return log.records


def run_trl(
    task: str,
    seed: int,
    model_dir: str,
    prompts: int,
    samples_per_step: int,
    out: Path,
    stop_level: float | None,
) -> list[dict]:
    from trl import GRPOConfig, GRPOTrainer

    dataset, reward, completion_length, _ = task_setup(task)
    prompts_per_step = max(samples_per_step // GROUP_SIZE, 1)
    args = GRPOConfig(
        output_dir=str(out / run_name(task, "trl", seed)),
        max_steps=math.ceil(prompts / prompts_per_step),
        per_device_train_batch_size=prompts_per_step * GROUP_SIZE,
        num_generations=GROUP_SIZE,
        max_completion_length=completion_length,
        temperature=1.0,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=WARMUP_STEPS,
        use_vllm=False,
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=seed,
    )
    log = RewardLog(stop_level)
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        callbacks=[log.callback],
    )
    trainer.train()
    return log.records


def run_name(task: str, arm: str, seed: int) -> str:
    """A run's log and output names: the demo's as they always were, the other tasks' prefixed."""
    return f"{arm}-{seed}" if task == "demo" else f"{task}-{arm}-{seed}"


def child(
    task: str,
    arm: str,
    seed: int,
    model_dir: str,
    url: str,
    prompts: int,
    samples_per_step: int,
    result: str,
    stop_level: float | None,
) -> None:
    out = Path(result).parent
    if arm == "trl":
        records = run_trl(task, seed, model_dir, prompts, samples_per_step, out, stop_level)
    else:
        records = run_asyncgrpo(task, arm, seed, model_dir, url, prompts, out, stop_level)
    Path(result).write_text(json.dumps(records))


# -- the benchmark ------------------------------------------------------------------------------------


def warm_started_model(work: Path) -> tuple[Path, float]:
    """The demo's warm start (deterministic): the model every arm starts from, and its expected
    accuracy when sampling at temperature 1."""
    import torch

    from asyncgrpo.cli.demo import warm_start
    from asyncgrpo.cli.tiny_model import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = build_model(tokenizer)
    accuracy = warm_start(model, tokenizer)
    model.save_pretrained(work / "warm-start")
    tokenizer.save_pretrained(work / "warm-start")
    return work / "warm-start", accuracy


def expected_accuracy(model_dir: Path) -> float:
    """The mean probability of the exact answer over the 100 prompts (what `warm_start` reports)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncgrpo.cli.demo import addition_prompt

    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(model_dir).eval(),
        AutoTokenizer.from_pretrained(model_dir),
    )
    total = 0.0
    with torch.no_grad():
        for a in range(10):
            for b in range(10):
                prompt = tokenizer.apply_chat_template(
                    addition_prompt(a, b), add_generation_prompt=True, tokenize=True
                )
                prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
                answer = tokenizer.encode(str(a + b)) + [tokenizer.eos_token_id]
                logprobs = torch.log_softmax(model(input_ids=torch.tensor([prompt + answer])).logits[0], -1)
                total += float(
                    sum(logprobs[len(prompt) - 1 + k, token] for k, token in enumerate(answer)).exp()
                )
    return total / 100


def long_task_start(model_dir: Path) -> float:
    """The long task's start: the mean reward of LONG_START_SAMPLES completions sampled from the
    start model at temperature 1, as the arms sample."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(model_dir).eval(),
        AutoTokenizer.from_pretrained(model_dir),
    )
    torch.manual_seed(0)
    prompts = long_dataset()["prompt"]
    rewards = []
    per_prompt = GROUP_SIZE
    with torch.no_grad():
        for prompt in prompts[: LONG_START_SAMPLES // per_prompt]:
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            generated = model.generate(
                torch.tensor([ids] * per_prompt),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=LONG_MAX_TOKENS,
                pad_token_id=tokenizer.eos_token_id,
            )[:, len(ids) :]
            for row in generated.tolist():
                if tokenizer.eos_token_id in row:
                    row = row[: row.index(tokenizer.eos_token_id) + 1]
                rewards.extend(even_token_share([row]))
    return statistics.mean(rewards)


def reset_server(url: str, model_dir: Path) -> None:
    """The next run starts at policy version 0 again: its requests must not reuse prefixes cached by
    the previous run's weights under the same version label."""
    from asyncgrpo.generation.client import VLLMClient

    async def reset():
        async with VLLMClient(url, timeout=120) as client:
            await client.resume()  # a synchronous run that ended mid-step leaves it paused
            await client.reload_weights(str(model_dir), version="0")
            await client.reset_prefix_cache()

    asyncio.run(reset())


def threshold(records: list[dict], level: float) -> tuple[int, float] | None:
    """(step, minutes) of the first log where the moving mean of the rewards reaches `level`."""
    rewards = [record["reward"] for record in records]
    for index, record in enumerate(records):
        window = rewards[max(0, index + 1 - SMOOTHING) : index + 1]
        if len(window) == SMOOTHING and statistics.mean(window) >= level:
            return record["step"], record["seconds"] / 60
    return None


def fixed_cost_share(records: list[dict]) -> str:
    """The text ", fixed cost X of a S s step" for a run's logs that carry the overlap figures (asyncgrpo's):
    the summed `perf/fixed_cost_s` over the summed `perf/step_s`."""
    logged = [r for r in records if "perf/fixed_cost_s" in r and "perf/step_s" in r]
    if not logged:
        return ""
    share = sum(r["perf/fixed_cost_s"] for r in logged) / sum(r["perf/step_s"] for r in logged)
    mean_step = statistics.mean(r["perf/step_s"] for r in logged)
    return f", fixed cost {share:.3f} of a {mean_step:.2f} s step"


def median_minutes(runs: list[list[dict]], level: float) -> float:
    """The median over seeds of the minutes to `level`, a seed that never reached it counting as
    infinitely slow (so the median is infinite when most seeds did not reach it)."""
    hits = [threshold(records, level) for records in runs]
    return statistics.median(math.inf if hit is None else hit[1] for hit in hits)


def summarize(results: dict[str, list[list[dict]]], start: float) -> list[dict]:
    rows = []
    for arm, runs in results.items():
        finals = [statistics.mean(r["reward"] for r in records[-SMOOTHING:]) for records in runs if records]
        row = {
            "arm": arm,
            "seeds": len(runs),
            "steps": statistics.mean(records[-1]["step"] for records in runs),
            "minutes": statistics.mean(records[-1]["seconds"] / 60 for records in runs),
            "final": statistics.mean(finals),
            # across seeds; with one seed, the spread of its last logged rewards
            "spread": statistics.stdev(finals)
            if len(finals) > 1
            else statistics.stdev([r["reward"] for r in runs[0][-SMOOTHING:]]),
        }
        row["median_minutes_to_+0.3"] = median_minutes(runs, start + 0.3)
        for gain in GAINS:
            hits = [threshold(records, start + gain) for records in runs]
            reached = [hit for hit in hits if hit is not None]
            row[f"+{gain}"] = (
                (statistics.mean(h[0] for h in reached), statistics.mean(h[1] for h in reached), len(reached))
                if reached
                else None
            )
        rows.append(row)
    return rows


def print_table(rows: list[dict], start: float) -> None:
    print(f"\nstart (the start model's expected reward): {start:.3f}")
    header = f"{'arm':<24}{'seeds':>6}{'steps':>7}{'min':>7}{'final reward':>16}"
    header += "".join(f"{'steps/min to +' + str(g):>24}" for g in GAINS)
    print(header)
    for row in rows:
        line = f"{row['arm']:<24}{row['seeds']:>6}{row['steps']:>7.0f}{row['minutes']:>7.1f}"
        line += f"{row['final']:>10.3f} ±{row['spread']:.3f}"
        for gain in GAINS:
            hit = row[f"+{gain}"]
            cell = "not reached" if hit is None else f"{hit[0]:.0f} / {hit[1]:.1f} ({hit[2]}/{row['seeds']})"
            line += f"{cell:>24}"
        print(line)


def plot(results: dict[str, list[list[dict]]], start: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm, runs in results.items():
        for index, records in enumerate(runs):
            smooth = [
                statistics.mean(r["reward"] for r in records[max(0, i + 1 - SMOOTHING) : i + 1])
                for i in range(len(records))
            ]
            color = f"C{ARMS.index(arm)}"
            label = arm if index == 0 else None
            by_step.plot([r["step"] for r in records], smooth, color=color, label=label, alpha=0.85)
            by_time.plot([r["seconds"] / 60 for r in records], smooth, color=color, label=label, alpha=0.85)
    for axis, xlabel in ((by_step, "optimizer steps"), (by_time, "minutes of training")):
        for gain in (0.0, *GAINS):
            axis.axhline(start + gain, color="grey", linewidth=0.6, linestyle=":" if gain else "-")
        axis.set_xlabel(xlabel)
        axis.set_ylabel(f"reward (mean of the last {SMOOTHING} logs)")
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 seed, 1000 prompts (about 60 optimizer steps)"
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--prompts",
        type=int,
        default=2000,
        help="prompts each run consumes (about 11 per asyncgrpo step here)",
    )
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument(
        "--out", default=None, help="where the per-run logs, table and plot go (default: a temp dir)"
    )
    parser.add_argument(
        "--model", metavar="DIR", help="start from this warm-started model (skips the warm start)"
    )
    parser.add_argument(
        "--summarize", metavar="DIR", help="only rebuild the demo's table and plot from DIR's run logs"
    )
    parser.add_argument(
        "--stop-at-gain",
        type=float,
        default=None,
        help="end each run once its moving mean reward reaches start + this (the minutes to it are "
        "what the race reads; the prompts are then only a cap)",
    )
    parser.add_argument("--child", nargs=9, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.summarize:
        out = Path(options.summarize).resolve()
        results = {
            arm: [json.loads(path.read_text()) for path in sorted(out.glob(f"{arm}-*.json"))] for arm in ARMS
        }
        report(
            "demo",
            {arm: runs for arm, runs in results.items() if runs},
            expected_accuracy(out / "warm-start"),
            out,
            [],
        )
        return
    if options.child:
        task, arm, seed, model_dir, url, prompts, samples_per_step, result, stop = options.child
        stop_level = None if stop == "-" else float(stop)
        child(task, arm, int(seed), model_dir, url, int(prompts), int(samples_per_step), result, stop_level)
        return
    if options.quick:
        options.seeds, options.prompts = 1, 1000
    arms = [arm for arm in options.arms.split(",") if arm]
    tasks = [task for task in options.tasks.split(",") if task]
    unknown = (set(arms) - set(ARMS)) | (set(tasks) - set(TASKS))
    if unknown:
        raise SystemExit(f"unknown arms or tasks {sorted(unknown)}; choose from {ARMS} and {TASKS}")
    if "trl" in arms:
        ensure_trl()
    out = Path(options.out or tempfile.mkdtemp(prefix="asyncgrpo-learning-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    for task in tasks:
        model_dir, start = start_model(task, options.model, out)
        print(f"[learning] {task}: start model in {model_dir}, start reward {start:.3f}", flush=True)
        results = run_task(
            task, arms, model_dir, start, options.seeds, options.prompts, out, failures, options.stop_at_gain
        )
        report(task, {arm: runs for arm, runs in results.items() if runs}, start, out, failures)
    if failures:
        raise SystemExit(1)


def start_model(task: str, warm_started: str | None, out: Path) -> tuple[Path, float]:
    """The model every arm of `task` starts from, and its expected reward."""
    if task == "long":
        from asyncgrpo.cli.tiny_model import save_tiny_model

        model_dir = save_tiny_model(out / "tiny-long")
        return model_dir, long_task_start(model_dir)
    if warm_started:
        model_dir = Path(warm_started).resolve()
        return model_dir, expected_accuracy(model_dir)
    return warm_started_model(out)


def run_task(
    task: str,
    arms: list[str],
    model_dir: Path,
    start: float,
    seeds: int,
    prompts: int,
    out: Path,
    failures: list[str],
    stop_at_gain: float | None = None,
) -> dict[str, list[list[dict]]]:
    from asyncgrpo.generation.server import ServerOptions, VLLMServer

    server = None
    if any(arm != "trl" for arm in arms):
        options_ = ServerOptions(
            model=str(model_dir), port=free_port(), max_model_len=512, dtype="float32", cpu=True
        )
        server = VLLMServer(options_, log_path=out / f"vllm-{task}.log")
        server.start()
    results: dict[str, list[list[dict]]] = {arm: [] for arm in arms}
    samples_per_step = GROUP_SIZE * 4
    try:
        for seed in range(seeds):
            for arm in arms:
                if arm != "trl":
                    reset_server(server.options.url, model_dir)
                result = out / f"{run_name(task, arm, seed)}.json"
                stop = "-" if stop_at_gain is None else str(start + stop_at_gain)
                command = [sys.executable, __file__, "--child", task, arm, str(seed), str(model_dir),
                           server.options.url if server else "-", str(prompts), str(samples_per_step),
                           str(result), stop]  # fmt: skip
                began = time.time()
                finished = subprocess.run(command, check=False, env={**os.environ, "PYTHONUNBUFFERED": "1"})
                if finished.returncode != 0 or not result.exists():
                    failures.append(f"{task} {arm} seed {seed}")  # the other runs still tell something
                    print(
                        f"[learning] FAILED: {task} {arm} seed {seed} (exit {finished.returncode})",
                        flush=True,
                    )
                    continue
                records = json.loads(result.read_text())
                results[arm].append(records)
                hit = threshold(records, start + 0.3)
                print(f"[learning] {task} {arm} seed {seed}: {records[-1]['step']} steps, "
                      f"{(time.time() - began) / 60:.1f} min with start-up, last reward "
                      f"{records[-1]['reward']:.3f}, minutes to +0.3 "
                      f"{'not_reached' if hit is None else f'{hit[1]:.2f}'}, load average "
                      f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}{fixed_cost_share(records)}",
                      flush=True)  # fmt: skip
                if arm == "asyncgrpo" and seed == 0:  # TRL gets the same samples per optimizer step
                    measured = [r["batch/samples_per_step"] for r in records if "batch/samples_per_step" in r]
                    samples_per_step = max(
                        GROUP_SIZE, round(statistics.mean(measured) / GROUP_SIZE) * GROUP_SIZE
                    )
                    print("[learning] asyncgrpo trained "
                          f"{statistics.mean(measured):.1f} samples per step: TRL "
                          f"gets {samples_per_step}", flush=True)  # fmt: skip
    finally:
        if server is not None:
            server.stop()
    return results


def report(
    task: str, results: dict[str, list[list[dict]]], start: float, out: Path, failures: list[str]
) -> None:
    rows = summarize(results, start)
    print_table(rows, start)
    suffix = "" if task == "demo" else f"_{task}"
    title = (
        "demo task (tiny model after its warm start)"
        if task == "demo"
        else f"long task ({LONG_MIN_TOKENS}-{LONG_MAX_TOKENS} token completions, tiny model as built)"
    )
    plot(results, start, out / f"learning{suffix}.png", f"{title}: asyncgrpo vs TRL GRPOTrainer")
    (out / f"summary{suffix}.json").write_text(json.dumps({"start": start, "rows": rows}, indent=1))
    print(f"\n[learning] per-run logs, summary{suffix}.json and learning{suffix}.png in {out}")

    def minutes(arm: str) -> str:  # the median over the seeds
        row = next((row for row in rows if row["arm"] == arm), None)
        median = math.inf if row is None else row["median_minutes_to_+0.3"]
        return "not_reached" if math.isinf(median) else f"{median:.2f}"

    if failures:
        print(f"[learning] failed runs (left out above): {', '.join(failures)}")
    print(f"learning{suffix} minutes_to_plus_0.3 asyncgrpo={minutes('asyncgrpo')} trl={minutes('trl')}")


if __name__ == "__main__":
    main()
