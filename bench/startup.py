"""Time to the first optimizer step, read from the run's timeline: where a short run's start-up goes.

Each run trains the tiny offline model (`asyncgrpo tiny-model`) for 2 steps against one vLLM CPU
server, in a fresh interpreter, and reads its timeline.json (docs/timeline.md): seconds from the
trainer's first event (opening the generation session) to the end of the first optimizer step, and
the start-up phases in between (the session's opening, the first weight sync, waiting for the rollout
worker, the first step). `--code A,B` alternates runs of two copies of the package (a directory
holding an `asyncgrpo/` each), so a before/after comparison sees the same server and the same load.
Run: `.venv/bin/python bench/startup.py [--runs N] [--code DIR_A,DIR_B]`.
The last line: `startup seconds_to_first_step median=X` (one per code copy with --code).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# The start-up phases on the trainer's lane; waiting for the worker was named "start rollout worker"
# before the worker started up during the first sync.
PHASES = ("open generation session", "weight sync", "start rollout worker", "wait for rollout worker", "step")


def child(model_dir: str, url: str, out: str) -> None:
    import torch
    from datasets import Dataset

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer

    torch.set_num_threads(1)  # the server generates on the same cores
    args = AsyncGRPOConfig(
        output_dir=out,
        vllm_server_base_url=url,
        max_steps=2,
        num_generations=4,
        max_completion_length=16,
        token_budget=256,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(40)]}
    )
    AsyncGRPOTrainer(model_dir, even_token_share, args, train_dataset=dataset).train()


def even_token_share(completion_ids, **kwargs):
    """Varies between the completions of a group (the tiny model's completions all run to the
    length limit, so a length reward would not)."""
    return [sum(1 for token in ids if token % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def start_up(timeline_path: Path) -> dict[str, float]:
    """Seconds from the first trainer event to the end of step 1's optimizer, and each phase's."""
    trace = json.loads(timeline_path.read_text())
    events = [item for item in trace["traceEvents"] if item["ph"] == "X" and item["pid"] == 1]
    first = min(item["ts"] for item in events)
    optimizer = next(item for item in events if item["name"] == "optimizer" and item["args"]["step"] == 1)
    figures = {"to_first_step_s": (optimizer["ts"] + optimizer["dur"] - first) / 1e6}
    for name in PHASES:
        match = next(
            (item for item in events if item["name"] == name and item["args"]["step"] in (0, 1)), None
        )
        if match is not None:
            figures[name] = match["dur"] / 1e6
    return figures


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--code", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        child(*options.child)
        return
    from asyncgrpo.cli.tiny_model import save_tiny_model
    from asyncgrpo.generation.server import ServerOptions, VLLMServer

    work = Path(tempfile.mkdtemp(prefix="asyncgrpo-startup-"))
    model_dir = save_tiny_model(work / "tiny-model")
    server = VLLMServer(
        ServerOptions(model=str(model_dir), port=free_port(), max_model_len=512, dtype="float32", cpu=True),
        log_path=work / "vllm.log",
    )
    server.start()
    copies = options.code.split(",")
    results: dict[str, list[dict[str, float]]] = {copy: [] for copy in copies}
    try:
        for run in range(options.runs):
            for copy in copies:
                out = work / f"run-{run}-{copies.index(copy)}"
                env = {**os.environ, "PYTHONPATH": copy, "PYTHONUNBUFFERED": "1"}
                command = [sys.executable, __file__, "--child", str(model_dir), server.options.url, str(out)]
                subprocess.run(command, check=True, env=env, cwd=copy)
                figures = start_up(out / "timeline.json")
                results[copy].append(figures)
                print(f"[startup] {copy} run {run}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()))
    finally:
        server.stop()
    for copy, runs in results.items():
        names = runs[0].keys()
        medians = {name: statistics.median(run[name] for run in runs if name in run) for name in names}
        print(
            f"[startup] {copy}: median over {len(runs)} runs: "
            + ", ".join(f"{k} {v:.2f}" for k, v in medians.items())
        )
    for copy, runs in results.items():
        median = statistics.median(run["to_first_step_s"] for run in runs)
        print(
            f"startup seconds_to_first_step median={median:.2f}"
            + (f" code={copy}" if len(copies) > 1 else "")
        )


if __name__ == "__main__":
    main()
