"""The report's timeline plot: a few consecutive steps of a run's timeline.json, one row per kind of
activity, so a reader sees which side waited and what a weight sync stopped (docs/timeline.md)."""

from __future__ import annotations

import json
from pathlib import Path

from asyncgrpo.report.core_use import CoreSample, core_samples
from asyncgrpo.run.files import TIMELINE_FILE

# Consecutive steps drawn: enough to see a run's rhythm, few enough that each phase stays readable.
STEPS_DRAWN = 3
# Request lanes drawn one per row; more requests than this at once share the last row.
REQUEST_ROWS = 8
# Trainer events drawn: the step's phases (depth 1, under `step`) and their parts (depth 2).
TRAINER_DEPTHS = (1, 2)


def load_timeline(run_dir: Path) -> dict | None:
    """The run's trace, or None for a run without a readable one (recorded before timelines existed,
    or a file a power loss emptied before it reached the disk)."""
    path = Path(run_dir) / TIMELINE_FILE
    try:
        trace = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return None
    return trace if isinstance(trace, dict) and "traceEvents" in trace else None


def steps_to_draw(trace: dict, count: int = STEPS_DRAWN) -> list[int]:
    """The last `count` consecutive steps the file holds whole (a `step` event each): the last such
    run of steps, or the longest there is when none is that long."""
    finished = sorted(
        {
            item["args"]["step"]
            for item in trace["traceEvents"]
            if item["ph"] == "X" and item["name"] == "step"
        }
    )
    runs: list[list[int]] = []
    for step in finished:
        if runs and step == runs[-1][-1] + 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    long_enough = [run for run in runs if len(run) >= count]
    chosen = long_enough[-1] if long_enough else max(runs, key=len, default=[])
    return chosen[-count:]


def _rows(trace: dict, steps: list[int]) -> tuple[list[tuple[str, list[dict]]], float, float]:
    """(row label, events) from top to bottom, and the drawn interval (µs)."""
    process = {
        item["pid"]: item["args"]["name"]
        for item in trace["traceEvents"]
        if item["ph"] == "M" and item["name"] == "process_name"
    }
    lane = {
        (item["pid"], item["tid"]): item["args"]["name"]
        for item in trace["traceEvents"]
        if item["ph"] == "M" and item["name"] == "thread_name"
    }
    events = [item for item in trace["traceEvents"] if item["ph"] == "X"]
    frames = [item for item in events if item["name"] == "step" and item["args"].get("step") in steps]
    start = min(item["ts"] for item in frames)
    end = max(item["ts"] + item["dur"] for item in frames)
    shown = [item for item in events if item["ts"] < end and item["ts"] + item["dur"] > start]
    trainer = sorted(
        (
            item
            for item in shown
            if process[item["pid"]] == "trainer" and lane[(item["pid"], item["tid"])] == "main"
        ),
        key=lambda item: (item["ts"], -item["dur"]),
    )
    depth_rows: dict[int, list[dict]] = {depth: [] for depth in TRAINER_DEPTHS}
    open_ends: list[int] = []
    for item in trainer:
        while open_ends and open_ends[-1] <= item["ts"]:
            open_ends.pop()
        if len(open_ends) in depth_rows:
            depth_rows[len(open_ends)].append(item)
        open_ends.append(item["ts"] + item["dur"])
    # With several rollout workers, each has its request rows (its process lane's name leads them).
    several_workers = sum(name.startswith("rollout worker") for name in process.values()) > 1
    requests: dict[tuple[int, int], list[dict]] = {}
    scoring, held, paused = [], [], []
    servers: dict[str, list[dict]] = {}  # a row per server: its `serving` bars, gaps where it was out
    for item in shown:
        name = lane[(item["pid"], item["tid"])]
        if name.startswith("server "):
            servers.setdefault(name, []).append(item)
        elif name.startswith("request "):
            row = (item["pid"], min(int(name.split()[1]), REQUEST_ROWS - 1))
            requests.setdefault(row, []).append(item)
        elif item["name"] == "score":
            scoring.append(item)
        elif item["name"] == "backpressure":
            held.append(item)
        elif item["name"] == "paused":
            paused.append(item)
    rows = [("trainer: phases", depth_rows[1]), ("trainer: inside", depth_rows[2])]
    rows += [
        (
            f"{process[pid]}: request {index}" if several_workers else f"request {index}",
            requests[(pid, index)],
        )
        for pid, index in sorted(requests)
    ]
    rows += [("scoring", scoring), ("back-pressure", held), ("servers paused", paused)]
    rows += sorted(servers.items())
    return rows, start, end


def render_timeline(trace: dict, path: Path) -> list[int]:
    """Draw the last few consecutive steps into `path`; returns the steps drawn (none: nothing drawn)."""
    steps = steps_to_draw(trace)
    if not steps:
        return []
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot
    from matplotlib.patches import Patch

    rows, start, end = _rows(trace, steps)
    cpu = core_samples(trace)
    cores = trace.get("otherData", {}).get("cpu_cores") or 1
    labels = [label for label, _ in rows] + [f"CPU: {name} (row: {cores} cores)" for name in cpu]
    colors: dict[str, tuple] = {}
    palette = matplotlib.colormaps["tab20"].colors  # 20 distinct colors: more than the kinds of events
    core_palette = matplotlib.colormaps["Dark2"].colors  # apart from the events' colors
    figure, axis = pyplot.subplots(figsize=(14, 0.45 * len(labels) + 1.6), dpi=100)
    for index, samples in enumerate(cpu.values()):
        y = len(cpu) - 1 - index
        for tick, following in zip(samples, samples[1:]):
            if start <= tick.ts < end:
                _draw_tick(
                    axis,
                    tick,
                    (tick.ts - start) / 1e6,
                    (following.ts - tick.ts) / 1e6,
                    y,
                    cores,
                    colors,
                    core_palette,
                )
    for index, (_, events) in enumerate(rows):
        y = len(labels) - 1 - index
        for item in events:
            color = colors.setdefault(item["name"], palette[len(colors) % len(palette)])
            left = (max(item["ts"], start) - start) / 1e6
            width = (min(item["ts"] + item["dur"], end) - max(item["ts"], start)) / 1e6
            axis.broken_barh([(left, width)], (y - 0.4, 0.8), facecolors=color, alpha=0.8)
    axis.set_yticks(range(len(labels)))
    axis.set_yticklabels(list(reversed(labels)), fontsize=8)
    axis.set_xlim(0, (end - start) / 1e6)
    axis.set_xlabel("seconds")
    axis.set_title(f"Timeline of steps {steps[0]}-{steps[-1]} (timeline.json)", fontsize=10)
    axis.grid(axis="x", alpha=0.3)
    axis.legend(
        handles=[Patch(color=color, label=name) for name, color in colors.items()],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
    )
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)
    return steps


def _draw_tick(
    axis, tick: CoreSample, left: float, width: float, y: int, cores: int, colors, palette
) -> None:
    """One tick of a CPU row: the lane's processes stacked, each as tall as its share of the machine's
    cores and colored by the core it ran on (a full row: every core busy)."""
    bottom = y - 0.4
    for label, busy in tick.busy.items():
        core = tick.core.get(label)
        name = f"core {core}" if core is not None else "core unknown"
        color = colors.setdefault(name, palette[(core or 0) % len(palette)])
        height = 0.8 * busy / cores
        axis.bar(left, height, width, bottom=bottom, align="edge", color=color, linewidth=0)
        bottom += height
