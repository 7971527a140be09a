"""Where a run's step time goes per process and core, from its timeline.json's CPU counters.

For each trainer phase of the steps read (the `step` event's children: taking samples, with waiting
for them inside, forward, backward, optimizer, weight sync, ...), it prints the phase's mean seconds a
step and each process lane's mean cores busy during it; then the same over whole steps and over
start-up (before the first step), and how often each lane ran on each core.
Run: `.venv/bin/python bench/cores_by_phase.py RUN_DIR [--from-step 2]` (step 1 holds the first
forward's compilation; `--from-step` leaves it out).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

from asyncgrpo.report.core_use import core_samples, mean_busy
from asyncgrpo.run.files import TIMELINE_FILE

# Phases read apart: the step's children, and waiting for samples inside taking them.
PHASES = (
    "take samples",
    "wait for samples",
    "pack",
    "forward",
    "backward",
    "optimizer",
    "weight sync",
    "log",
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--from-step", type=int, default=2)
    options = parser.parse_args()
    trace = json.loads((options.run_dir / TIMELINE_FILE).read_text())
    lanes = core_samples(trace)
    names = {
        item["pid"]: item["args"]["name"] for item in trace["traceEvents"] if item["name"] == "process_name"
    }
    spans = [
        item
        for item in trace["traceEvents"]
        if item["ph"] == "X" and names[item["pid"]] == "trainer" and item["args"]["step"] >= options.from_step
    ]
    steps = {
        item["args"]["step"]: (item["ts"], item["ts"] + item["dur"])
        for item in spans
        if item["name"] == "step"
    }
    if not steps:
        raise SystemExit(f"{options.run_dir}: no step from {options.from_step} on in {TIMELINE_FILE}")
    intervals: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for item in spans:
        if item["name"] in PHASES and item["args"]["step"] in steps:  # not a step cut short by the run's end
            intervals[item["name"]].append((item["ts"], item["ts"] + item["dur"]))
    intervals["step"] = list(steps.values())
    cores = trace["otherData"].get("cpu_cores")
    print(f"{options.run_dir.name}: steps {min(steps)}-{max(steps)} ({len(steps)}), {cores} cores")
    print(f"{'phase':<18}{'s/step':>8}  " + "  ".join(f"{name:>16}" for name in lanes))
    for phase in (*PHASES, "step"):
        if phase not in intervals:
            continue
        seconds = sum(end - start for start, end in intervals[phase]) / 1e6 / len(steps)
        busy = [mean_busy(samples, intervals[phase]) for samples in lanes.values()]
        print(f"{phase:<18}{seconds:>8.3f}  " + "  ".join(f"{_fmt(value):>16}" for value in busy))
    first = min(item["ts"] for item in trace["traceEvents"] if item["ph"] != "M")
    all_steps = [item["ts"] for item in trace["traceEvents"] if item["ph"] == "X" and item["name"] == "step"]
    startup = [(first, min(all_steps))]
    print(
        f"{'start-up':<18}{(startup[0][1] - first) / 1e6:>8.1f}  "
        + "  ".join(f"{_fmt(mean_busy(samples, startup)):>16}" for samples in lanes.values())
    )
    for name, samples in lanes.items():
        inside = [tick for tick in samples if any(start <= tick.ts < end for start, end in intervals["step"])]
        counts = Counter(core for tick in inside for core in tick.core.values())
        total = sum(counts.values()) or 1
        shares = ", ".join(f"core {core} {count / total:.0%}" for core, count in sorted(counts.items()))
        print(f"{name}: ran on {shares} of its samples in steps")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
