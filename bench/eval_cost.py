"""What does an evaluation during training cost, in training steps? With and without overlap.

Three runs of the same training (tiny model, one vLLM CPU server, the same prompts and seed):
  none      no evaluation: the reference step time;
  overlap   an evaluation of N held-out prompts every E steps, as the trainer runs it: in the
            background, joined at the next weight sync (docs/architecture.md, "Evaluation");
  blocking  the same evaluations, but the trainer waits for each one as soon as it starts (a
            benchmark mode: what an evaluation costs when nothing overlaps it).
The cost of one evaluation, in steps, is the extra wall time of the run over `none`, divided by the
number of evaluations and by `none`'s mean step time. Also printed: the mean `eval_runtime` and the
mean `perf/eval_wait_s` (the part of an evaluation the trainer waited for).

Run: `.venv/bin/python bench/eval_cost.py [--prompts N] [--every E] [--steps S] [--generations G]`.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.cli.tiny_model import save_tiny_model
from asyncgrpo.generation.server import ServerOptions, VLLMServer

WARMUP_STEPS = 2  # the first steps wait for the first rollouts: not the steady step time


def length_reward(completion_ids, **kwargs) -> list[float]:
    """Any reward with variance will do: the bench times evaluations, not learning."""
    return [len(ids) / 16 for ids in completion_ids]


class BlockingEvalTrainer(AsyncGRPOTrainer):
    """Benchmark mode: every scheduled evaluation is waited for as soon as it starts."""

    def _start_eval(self, trial) -> None:
        super()._start_eval(trial)
        self._run.evaluations.join(trial)


def prompts(n: int, offset: int = 0) -> Dataset:
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"Say a word about {offset + i}."}] for i in range(n)]}
    )


def run(mode: str, url: str, model_dir: Path, out: Path, options: argparse.Namespace) -> dict:
    evaluates = mode != "none"
    args = AsyncGRPOConfig(
        output_dir=str(out / mode),
        vllm_server_base_url=url,
        max_steps=options.steps,
        num_generations=8,
        max_completion_length=16,
        token_budget=512,
        gradient_checkpointing=False,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        vllm_server_timeout=120,
        eval_strategy="steps" if evaluates else "no",
        eval_steps=options.every,
        num_generations_eval=options.generations,
    )
    trainer_class = BlockingEvalTrainer if mode == "blocking" else AsyncGRPOTrainer
    trainer = trainer_class(
        str(model_dir),
        length_reward,
        args,
        train_dataset=prompts(400),
        eval_dataset=prompts(options.prompts, offset=1000) if evaluates else None,
    )
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    history = trainer.state.log_history
    steps = [entry["perf/step_s"] for entry in history if "perf/step_s" in entry][WARMUP_STEPS:]
    evals = [entry for entry in history if "eval_runtime" in entry]
    waits = [entry["perf/eval_wait_s"] for entry in history if "perf/eval_wait_s" in entry]
    return {
        "wall_s": wall,
        "step_s": statistics.mean(steps),
        "evaluations": len(evals),
        "eval_runtime_s": statistics.mean(e["eval_runtime"] for e in evals) if evals else 0.0,
        "eval_wait_s": statistics.mean(waits) if waits else 0.0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts per evaluation (N)")
    parser.add_argument("--every", type=int, default=5, help="steps between evaluations (E)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run")
    parser.add_argument("--generations", type=int, default=4, help="num_generations_eval")
    options = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="eval-cost-"))
    model_dir = save_tiny_model(work / "tiny-model")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server_options = ServerOptions(
        model=str(model_dir), port=port, max_model_len=512, dtype="float32", cpu=True
    )
    server = VLLMServer(server_options, log_path=work / "vllm.log")
    server.start()
    results = {}
    try:
        for mode in ("none", "overlap", "blocking"):
            results[mode] = run(mode, server_options.url, model_dir, work, options)
            print(f"{mode}: {results[mode]}", flush=True)
    finally:
        server.stop()
    reference = results["none"]
    print(
        f"\neval of {options.prompts} prompts x {options.generations} rollouts, every {options.every} steps, "
        f"{options.steps} steps; reference step {reference['step_s']:.2f} s"
    )
    for mode in ("overlap", "blocking"):
        result = results[mode]
        extra = (result["wall_s"] - reference["wall_s"]) / max(result["evaluations"], 1)
        print(
            f"{mode:9s} {result['evaluations']} evaluations, eval_runtime {result['eval_runtime_s']:.2f} s "
            f"({result['eval_runtime_s'] / reference['step_s']:.2f} steps), trainer waited "
            f"{result['eval_wait_s']:.2f} s per evaluation; extra wall time per evaluation {extra:.2f} s = "
            f"{extra / reference['step_s']:.2f} steps"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
