"""The report's reading of the timeline's CPU counters (asyncgrpo/run/cpu_use.py): per process lane, the
cores its processes kept busy and the core each ran on, and the diagnosis's line of averages."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncgrpo.run.cpu_use import BUSY_COUNTER, CORE_PREFIX


@dataclass
class CoreSample:
    """One tick of one process lane: from `ts` (µs) on, each process's cores busy and core."""

    ts: int
    busy: dict[str, float]
    core: dict[str, int] = field(default_factory=dict)


def process_names(trace: dict) -> dict[int, str]:
    return {
        item["pid"]: item["args"]["name"]
        for item in trace["traceEvents"]
        if item["ph"] == "M" and item["name"] == "process_name"
    }


def core_samples(trace: dict) -> dict[str, list[CoreSample]]:
    """Per process lane (by name, in the file's order), its ticks in time order."""
    names = process_names(trace)
    samples: dict[str, dict[int, CoreSample]] = {}
    cores: list[dict] = []
    for item in trace["traceEvents"]:
        if item["ph"] != "C":
            continue
        if item["name"] == BUSY_COUNTER:
            lane = samples.setdefault(names[item["pid"]], {})
            lane[item["ts"]] = CoreSample(item["ts"], dict(item["args"]))
        elif item["name"].startswith(CORE_PREFIX):
            cores.append(item)
    for item in cores:
        tick = samples.get(names[item["pid"]], {}).get(item["ts"])
        if tick is not None:
            tick.core[item["name"][len(CORE_PREFIX) :]] = item["args"]["core"]
    ordered = sorted(samples, key=lambda name: min(pid for pid, known in names.items() if known == name))
    return {name: [samples[name][ts] for ts in sorted(samples[name])] for name in ordered}


def mean_busy(samples: list[CoreSample], intervals: list[tuple[int, int]]) -> float | None:
    """The lane's cores busy (its processes together), averaged over the ticks that start inside one
    of `intervals`; None without any. Ticks are evenly spaced, so the plain mean weighs time evenly."""
    inside = [sum(s.busy.values()) for s in samples if any(start <= s.ts < end for start, end in intervals)]
    return sum(inside) / len(inside) if inside else None


def _steps(trace: dict) -> dict[int, tuple[int, int]]:
    return {
        item["args"]["step"]: (item["ts"], item["ts"] + item["dur"])
        for item in trace["traceEvents"]
        if item["ph"] == "X" and item["name"] == "step"
    }


def cores_lines(trace: dict) -> list[str]:
    """The diagnosis's evidence: each process lane's cores busy on average over the kept steps, and
    over start-up (before the first step) where the file has it; empty without CPU counters."""
    lanes = core_samples(trace)
    if not lanes:
        return []
    available = trace.get("otherData", {}).get("cpu_cores")
    out_of = f" of {available} available" if available else ""
    steps = _steps(trace)
    lines = []
    if steps:
        first, last = min(steps), max(steps)
        averages = {name: mean_busy(samples, list(steps.values())) for name, samples in lanes.items()}
        kept = len(steps)
        span = f"steps {first}-{last}" + (f" ({kept} kept)" if kept != last - first + 1 else "")
        lines.append(_line(averages, f"over {span}{out_of}"))
        start = min(item["ts"] for item in trace["traceEvents"] if item["ph"] != "M")
        before = [(start, steps[first][0])]
        averages = {name: mean_busy(samples, before) for name, samples in lanes.items()}
        lines.append(_line(averages, f"over start-up, before step {first}{out_of}"))
    return [line for line in lines if line]


def _line(averages: dict[str, float | None], where: str) -> str:
    known = {name: value for name, value in averages.items() if value is not None}
    if not known:
        return ""
    parts = ", ".join(f"{name} {value:.2f}" for name, value in known.items())
    return f"cores: {parts} busy on average {where} (together {sum(known.values()):.2f})"
