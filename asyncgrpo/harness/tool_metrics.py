"""The tool metrics of a harness rollout, read from what the trainer sees of its tool calls.

Loop-owning, the agent runs its tools itself: the capture sees the calls the model makes (each
reply's `tool_calls`) and the tools the agent offered (each request's `tools`), not whether a tool
failed or how long it ran. White-box, the adapter's tool trace says which calls returned an error.
The names are the built-in tool loop's (docs/metrics.md, "Tools"); what each mode cannot know is
not logged. A call's name is the model's to choose: only the names of tools the session declared
become metric names, every other call counts under UNDECLARED, so the model cannot make up metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncgrpo.records.metrics import MetricsWindow, Reduce

# The per-tool name under which calls to a tool the session did not declare are counted.
UNDECLARED = "undeclared"


@dataclass
class ToolCallCounts:
    """A rollout's tool calls: per declared tool name (UNDECLARED for the others), calls and failed
    calls (None: failures unknown), the number of calls of each reply that made any, and calls to a
    tool the request did not offer."""

    calls: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] | None = None
    per_reply: list[int] = field(default_factory=list)
    unknown_names: int = 0

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def record(self, metrics: MetricsWindow) -> None:
        metrics.record("tools/call_frequency", self.total)
        metrics.record("tools/unknown_name_count", self.unknown_names, Reduce.SUM)
        for count in self.per_reply:
            metrics.record("tools/parallel_calls_mean", count)
        for name, count in self.calls.items():
            metrics.record(f"tools/{name}/call_count", count, Reduce.SUM)
        if self.failures is None:
            return
        for name, count in self.failures.items():
            metrics.record(f"tools/{name}/failure_count", count, Reduce.SUM)
        if self.total:  # a calls-weighted mean: NaN in a window without calls
            metrics.record(
                "tools/failure_frequency", sum(self.failures.values()) / self.total, weight=self.total
            )


def captured_tool_calls(entries: list[dict[str, Any]]) -> ToolCallCounts:
    """The tool calls of a loop-owning session's captured turns (OpenEnv trace entries: each a
    `request` with its `tools` and a `response` with its `choices`)."""
    counts = ToolCallCounts()
    for entry in entries:
        offered = {
            (tool.get("function") or {}).get("name")
            for tool in (entry.get("request") or {}).get("tools") or []
        }
        choices = (entry.get("response") or {}).get("choices") or [{}]
        calls = (choices[0].get("message") or {}).get("tool_calls") or []
        if calls:
            counts.per_reply.append(len(calls))
        for call in calls:
            name = (call.get("function") or {}).get("name") or ""
            declared = name in offered
            key = name if declared else UNDECLARED
            counts.calls[key] = counts.calls.get(key, 0) + 1
            counts.unknown_names += not declared
    return counts


def white_box_tool_calls(tool_trace, declared: set[str]) -> ToolCallCounts:
    """The tool calls of a white-box session, from its adapter's `tool_trace` (`ToolTraceEntry`s: a
    call failed when its result carries an error); `declared`: the names of the tools the session
    listed."""
    counts = ToolCallCounts(failures={})
    for entry in tool_trace:
        name = entry.tool_name if entry.tool_name in declared else UNDECLARED
        counts.calls[name] = counts.calls.get(name, 0) + 1
        counts.failures[name] = counts.failures.get(name, 0) + int(entry.result.error is not None)
    return counts
