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

Reward is the mean reward of the completions each logged step generated (both trainers log it as
`reward`), recorded against optimizer steps and against wall-clock time from the start of training.
The start is the warm-started model's exact expected accuracy; "steps/minutes to +d" is the first
logged step where the mean of the last 10 logged rewards reaches start + d.
Machine notes: the vLLM server and the asyncgrpo trainer share the CPU cores (trainer: one torch
thread, as in the demo); TRL has no server and gets the torch threads it wants.
Run: `.venv/bin/python bench/learning.py [--quick] [--seeds N] [--prompts P] [--arms a,b] [--out DIR]`.
The last line: `learning minutes_to_plus_0.3 asyncgrpo=X trl=Y`.
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
GAINS = (0.2, 0.3)
HERE = Path(__file__).resolve().parent


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
    """(step, seconds since training began, reward) at every log that carries a reward."""

    def __init__(self):
        from transformers import TrainerCallback

        records = self.records = []
        started = [0.0]

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                started[0] = time.time()

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "reward" in logs:
                    extra = {key: logs[key] for key in ("batch/samples_per_step",) if key in logs}
                    records.append({"step": state.global_step, "seconds": time.time() - started[0],
                                    "reward": float(logs["reward"]), **extra})  # fmt: skip

        self.callback = Callback()


def run_asyncgrpo(arm: str, seed: int, model_dir: str, url: str, prompts: int, out: Path) -> list[dict]:
    import torch

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.cli.demo import addition_dataset, correct_sum

    sys.path.insert(0, str(HERE))
    from overlap import SynchronousTrainer

    torch.set_num_threads(1)  # the server generates on the same cores (asyncgrpo/cli/demo.py says why)
    args = AsyncGRPOConfig(
        output_dir=str(out / f"{arm}-{seed}"),
        vllm_server_base_url=url,
        num_train_epochs=prompts / DATASET_SIZE,  # epochs count prompts consumed
        num_generations=GROUP_SIZE,
        max_completion_length=MAX_COMPLETION_LENGTH,
        temperature=1.0,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=WARMUP_STEPS,
        token_budget=TOKEN_BUDGET,
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
    log = RewardLog()
    trainer = trainer_class(
        model_dir, correct_sum, args, train_dataset=addition_dataset(), callbacks=[log.callback]
    )
    trainer.train()
    return log.records


def run_trl(seed: int, model_dir: str, prompts: int, samples_per_step: int, out: Path) -> list[dict]:
    from trl import GRPOConfig, GRPOTrainer

    from asyncgrpo.cli.demo import addition_dataset, correct_sum

    prompts_per_step = max(samples_per_step // GROUP_SIZE, 1)
    args = GRPOConfig(
        output_dir=str(out / f"trl-{seed}"),
        max_steps=math.ceil(prompts / prompts_per_step),
        per_device_train_batch_size=prompts_per_step * GROUP_SIZE,
        num_generations=GROUP_SIZE,
        max_completion_length=MAX_COMPLETION_LENGTH,
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
    log = RewardLog()
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=correct_sum,
        args=args,
        train_dataset=addition_dataset(),
        callbacks=[log.callback],
    )
    trainer.train()
    return log.records


def child(
    arm: str, seed: int, model_dir: str, url: str, prompts: int, samples_per_step: int, result: str
) -> None:
    out = Path(result).parent
    if arm == "trl":
        records = run_trl(seed, model_dir, prompts, samples_per_step, out)
    else:
        records = run_asyncgrpo(arm, seed, model_dir, url, prompts, out)
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
    print(f"\nstart (warm-started model's expected accuracy): {start:.3f}")
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


def plot(results: dict[str, list[list[dict]]], start: float, path: Path) -> None:
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
    figure.suptitle("demo task (tiny model after its warm start): asyncgrpo vs TRL GRPOTrainer")
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
    parser.add_argument(
        "--out", default=None, help="where the per-run logs, table and plot go (default: a temp dir)"
    )
    parser.add_argument(
        "--model", metavar="DIR", help="start from this warm-started model (skips the warm start)"
    )
    parser.add_argument(
        "--summarize", metavar="DIR", help="only rebuild the table and plot from DIR's run logs"
    )
    parser.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.summarize:
        out = Path(options.summarize).resolve()
        results = {
            arm: [json.loads(path.read_text()) for path in sorted(out.glob(f"{arm}-*.json"))] for arm in ARMS
        }
        report(
            {arm: runs for arm, runs in results.items() if runs},
            expected_accuracy(out / "warm-start"),
            out,
            [],
        )
        return
    if options.child:
        arm, seed, model_dir, url, prompts, samples_per_step, result = options.child
        child(arm, int(seed), model_dir, url, int(prompts), int(samples_per_step), result)
        return
    if options.quick:
        options.seeds, options.prompts = 1, 1000
    arms = [arm for arm in options.arms.split(",") if arm]
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise SystemExit(f"unknown arms {sorted(unknown)}; choose from {ARMS}")
    if "trl" in arms:
        ensure_trl()
    out = Path(options.out or tempfile.mkdtemp(prefix="asyncgrpo-learning-")).resolve()
    out.mkdir(parents=True, exist_ok=True)

    from asyncgrpo.generation.server import ServerOptions, VLLMServer

    if options.model:
        model_dir = Path(options.model).resolve()
        start = expected_accuracy(model_dir)
    else:
        model_dir, start = warm_started_model(out)
    print(f"[learning] warm-started model in {model_dir}: expected accuracy {start:.3f}", flush=True)
    server = None
    if any(arm != "trl" for arm in arms):
        options_ = ServerOptions(
            model=str(model_dir), port=free_port(), max_model_len=512, dtype="float32", cpu=True
        )
        server = VLLMServer(options_, log_path=out / "vllm.log")
        server.start()
    results: dict[str, list[list[dict]]] = {arm: [] for arm in arms}
    samples_per_step = GROUP_SIZE * 4
    failures: list[str] = []
    try:
        for seed in range(options.seeds):
            for arm in arms:
                if arm != "trl":
                    reset_server(server.options.url, model_dir)
                result = out / f"{arm}-{seed}.json"
                command = [sys.executable, __file__, "--child", arm, str(seed), str(model_dir),
                           server.options.url if server else "-", str(options.prompts), str(samples_per_step),
                           str(result)]  # fmt: skip
                began = time.time()
                finished = subprocess.run(command, check=False, env={**os.environ, "PYTHONUNBUFFERED": "1"})
                if finished.returncode != 0 or not result.exists():
                    failures.append(f"{arm} seed {seed}")  # the other runs still tell something
                    print(f"[learning] FAILED: {arm} seed {seed} (exit {finished.returncode})", flush=True)
                    continue
                records = json.loads(result.read_text())
                results[arm].append(records)
                print(f"[learning] {arm} seed {seed}: {records[-1]['step']} steps, "
                      f"{(time.time() - began) / 60:.1f} min with start-up, last reward "
                      f"{records[-1]['reward']:.3f}", flush=True)  # fmt: skip
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
    report({arm: runs for arm, runs in results.items() if runs}, start, out, failures)


def report(results: dict[str, list[list[dict]]], start: float, out: Path, failures: list[str]) -> None:
    rows = summarize(results, start)
    print_table(rows, start)
    plot(results, start, out / "learning.png")
    (out / "summary.json").write_text(json.dumps({"start": start, "rows": rows}, indent=1))
    print(f"\n[learning] per-run logs, summary.json and learning.png in {out}")

    def minutes(arm: str) -> str:
        row = next((row for row in rows if row["arm"] == arm), None)
        hit = None if row is None else row["+0.3"]
        return "not_reached" if hit is None else f"{hit[1]:.2f}"

    if failures:
        print(f"[learning] failed runs (left out above): {', '.join(failures)}")
    print(f"learning minutes_to_plus_0.3 asyncgrpo={minutes('asyncgrpo')} trl={minutes('trl')}")
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
