"""Checks of a Chrome trace-event file that the timeline tests share."""

from __future__ import annotations

from collections import defaultdict


def complete_events(trace: dict) -> list[dict]:
    """The trace's complete events, after checking each has what the format asks of it."""
    events = [item for item in trace["traceEvents"] if item["ph"] == "X"]
    for item in events:
        assert isinstance(item["name"], str) and item["name"]
        assert isinstance(item["ts"], int) and isinstance(item["dur"], int) and item["dur"] >= 0, item
        assert isinstance(item["pid"], int) and isinstance(item["tid"], int), item
    return events


def assert_nested(trace: dict) -> None:
    """On each lane (pid, tid) two events are disjoint or one holds the other, as the format needs
    for complete events on one thread."""
    lanes = defaultdict(list)
    for item in complete_events(trace):
        lanes[(item["pid"], item["tid"])].append(item)
    for lane, events in lanes.items():
        events.sort(key=lambda item: (item["ts"], -item["dur"]))
        open_ends: list[int] = []
        for item in events:
            while open_ends and open_ends[-1] <= item["ts"]:
                open_ends.pop()
            end = item["ts"] + item["dur"]
            assert not open_ends or end <= open_ends[-1], f"{item} overlaps its parent on lane {lane}"
            open_ends.append(end)


def names_by_process(trace: dict) -> dict[str, set[str]]:
    """{process name: the names of its events}."""
    process_names = {
        item["pid"]: item["args"]["name"]
        for item in trace["traceEvents"]
        if item["ph"] == "M" and item["name"] == "process_name"
    }
    names: dict[str, set[str]] = defaultdict(set)
    for item in complete_events(trace):
        names[process_names[item["pid"]]].add(item["name"])
    return names
