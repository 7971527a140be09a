"""Does every loss_type learn? The demo task (asyncgrpo/cli/demo.py: "What is a + b?", reward 1 for the
exact sum, the tiny model after its supervised warm start) trained once per loss type, against the real
vLLM CPU server, with bench/learning.py's settings (group 16, lr 6e-4 constant after 5 warm-up steps,
8 tokens, temperature 1, token_budget 256, max_staleness 1) and its reading of a run: "steps to +0.3" is
the first logged step where the mean of the last 10 logged rewards reaches the start's expected reward
+ 0.3; "final" is the mean of the last 10.

Each arm changes only what its loss needs: `luspo` runs sequence ratios (TRL warns without them), `cispo`
takes TRL's recommended epsilon_high=5.0 (its ratio cap; TRL's default epsilon_high would cap it at
0.2), and `gspo` is grpo with sequence ratios. `default` is asyncgrpo's score-centered loss (no loss_type).
Prints one line per arm and the table; exits non-zero when an arm never reaches +0.3.
Run: `flock /work/heavy.lock .venv/bin/python bench/loss_types.py [--prompts P] [--arms a,b] [--model DIR]
[--out DIR]` (one run at a time: the server and the trainer share the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from learning import (  # noqa: E402
    DATASET_SIZE,
    GROUP_SIZE,
    LEARNING_RATE,
    SMOOTHING,
    WARMUP_STEPS,
    RewardLog,
    expected_accuracy,
    free_port,
    reset_server,
    task_setup,
    threshold,
    warm_started_model,
)

ARMS = {
    "default": {},
    "grpo": {"loss_type": "grpo"},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "dapo": {"loss_type": "dapo"},
    "bnpo": {"loss_type": "bnpo"},
    "cispo": {"loss_type": "cispo", "epsilon_high": 5.0},
    "sapo": {"loss_type": "sapo"},
    "luspo": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "vespo": {"loss_type": "vespo"},
}
GAIN = 0.3


def run(arm: str, model_dir: str, url: str, prompts: int, out: Path) -> list[dict]:
    """One training run (a child process), its logged rewards."""
    import torch

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer

    torch.set_num_threads(1)  # the server generates on the same cores
    dataset, reward, completion_length, token_budget = task_setup("demo")
    args = AsyncGRPOConfig(
        output_dir=str(out / arm),
        vllm_server_base_url=url,
        num_train_epochs=prompts / DATASET_SIZE,
        num_generations=GROUP_SIZE,
        max_completion_length=completion_length,
        temperature=1.0,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=WARMUP_STEPS,
        token_budget=token_budget,
        max_staleness=1,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        vllm_server_timeout=300,
        **ARMS[arm],
    )
    log = RewardLog()
    AsyncGRPOTrainer(model_dir, reward, args, train_dataset=dataset, callbacks=[log.callback]).train()
    return log.records


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=1000, help="prompts per run (~11 per step)")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--model", metavar="DIR", help="the warm-started model (skips the warm start)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        arm, model_dir, url, prompts, result = options.child
        records = run(arm, model_dir, url, int(prompts), Path(result).parent)
        Path(result).write_text(json.dumps(records))
        return 0
    from asyncgrpo.generation.server import ServerOptions, VLLMServer

    arms = [arm for arm in options.arms.split(",") if arm]
    out = Path(options.out or tempfile.mkdtemp(prefix="asyncgrpo-loss-types-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if options.model:
        model_dir, start = Path(options.model).resolve(), expected_accuracy(Path(options.model))
    else:
        model_dir, start = warm_started_model(out)
    print(f"[loss_types] start model {model_dir}, expected reward {start:.3f}", flush=True)
    server = VLLMServer(
        ServerOptions(model=str(model_dir), port=free_port(), max_model_len=512, dtype="float32", cpu=True),
        log_path=out / "vllm.log",
    )
    server.start()
    rows, failed = [], []
    try:
        for arm in arms:
            reset_server(server.options.url, model_dir)
            result = out / f"{arm}.json"
            began = time.time()
            command = [sys.executable, __file__, "--child", arm, str(model_dir), server.options.url,
                       str(options.prompts), str(result)]  # fmt: skip
            finished = subprocess.run(command, check=False, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            if finished.returncode != 0 or not result.exists():
                failed.append(arm)
                print(f"[loss_types] {arm}: FAILED (exit {finished.returncode})", flush=True)
                continue
            records = json.loads(result.read_text())
            hit = threshold(records, start + GAIN)
            final = statistics.mean(r["reward"] for r in records[-SMOOTHING:])
            row = {"arm": arm, "settings": ARMS[arm], "steps": records[-1]["step"], "final": final,
                   "steps_to_gain": None if hit is None else hit[0],
                   "minutes_to_gain": None if hit is None else hit[1],
                   "minutes": (time.time() - began) / 60}  # fmt: skip
            rows.append(row)
            if hit is None:
                failed.append(arm)
            print(f"[loss_types] {arm}: {row['steps']} steps, final {final:.3f}, steps to +{GAIN} "
                  f"{'not reached' if hit is None else hit[0]}, {row['minutes']:.1f} min with start-up, load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    finally:
        server.stop()
    (out / "summary.json").write_text(json.dumps({"start": start, "rows": rows}, indent=1))
    print(f"\nstart (expected reward of the warm-started model): {start:.3f}")
    print("| arm | settings | steps | steps to +0.3 | final reward |\n| --- | --- | --- | --- | --- |")
    for row in rows:
        settings = ", ".join(f"{k}={v}" for k, v in row["settings"].items()) or "(defaults)"
        reached = "not reached" if row["steps_to_gain"] is None else str(row["steps_to_gain"])
        print(f"| {row['arm']} | {settings} | {row['steps']} | {reached} | {row['final']:.3f} |")
    reached = sum(row["steps_to_gain"] is not None for row in rows)
    print(f"loss_types reached_plus_0.3={reached}/{len(arms)} failed={','.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
