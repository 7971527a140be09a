"""Running the tool calls of one assistant turn, and the per-call metrics.

Calls run one after another in the order the model emitted them (a later call may depend on an
earlier one's effect, e.g. two moves in a game). Sync tools run on the worker's thread pool and
async tools are awaited, so a slow tool holds back only its own rollout. Whatever goes wrong (an
unknown name, malformed call JSON, a tool that raises, a call past `tool_timeout`) becomes a tool
message the model sees and a counted failure; it never stops the run. A call past its deadline is
abandoned (an async tool cancelled; a sync tool's thread cannot be stopped and finishes on its own),
so a tool that never returns holds its rollout for `tool_timeout` at most.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import math
import time
from concurrent.futures import Executor
from typing import Any, Callable

from asyncgrpo.records.metrics import MetricsWindow, Reduce
from asyncgrpo.rollout.activity import ActivityBoard
from asyncgrpo.rollout.chat import tool_name
from asyncgrpo.rollout.tool_calls import ToolCall


def is_async_callable(function: Callable) -> bool:
    while isinstance(function, functools.partial):
        function = function.func
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
        getattr(function, "__call__", None)
    )


async def call_maybe_async(function: Callable, executor: Executor, *args, **kwargs) -> Any:
    """Await an async callable; run a sync one on `executor` (never on the event loop)."""
    if is_async_callable(function):
        return await function(*args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(
        executor, functools.partial(function, *args, **kwargs)
    )


def _as_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    if isinstance(result, (dict, list)):
        try:
            return json.dumps(result, ensure_ascii=False)
        except TypeError:
            return str(result)
    return str(result)


def _message(name: str, content: str) -> dict[str, str]:
    return {"role": "tool", "name": name, "content": content}


async def run_tool_calls(
    calls: list[ToolCall],
    tools: list[Callable],
    executor: Executor,
    metrics: Callable[[], MetricsWindow],
    timeout_s: float = math.inf,
    activity: ActivityBoard | None = None,
) -> tuple[list[dict[str, str]], int]:
    """(one tool message per call, in order; the number of failed calls). `metrics` returns the
    loop's current window (it is replaced at every flush); `timeout_s` bounds each call; `activity`
    is told which tool a call waits on."""
    activity = activity or ActivityBoard()
    by_name = {tool_name(tool): tool for tool in tools}
    messages, failures = [], 0
    metrics().record("tools/parallel_calls_mean", len(calls))
    for call in calls:
        if call.error is not None:
            failures += 1
            messages.append(_message(call.name or "", f"Error: {call.error}"))
            continue
        tool = by_name.get(call.name)
        if tool is None:
            failures += 1
            metrics().record("tools/unknown_name_count", 1, Reduce.SUM)
            known = ", ".join(sorted(by_name)) or "none"
            messages.append(
                _message(call.name, f"Error: there is no tool named {call.name!r} (tools: {known})")
            )
            continue
        started = time.monotonic()
        failed = False
        try:
            with activity.waiting_on(f"tool {call.name!r}"):
                result = await asyncio.wait_for(
                    call_maybe_async(tool, executor, **call.arguments),
                    None if math.isinf(timeout_s) else timeout_s,
                )
            content = _as_text(result)
        except asyncio.TimeoutError:
            failed = True
            metrics().record("tools/timeout_count", 1, Reduce.SUM)
            content = f"Error: the tool did not return within tool_timeout={timeout_s:g} s"
        except Exception as error:  # the tool's failure is the model's observation, not the run's end
            failed = True
            content = f"Error: {type(error).__name__}: {error}"
        latency = time.monotonic() - started
        failures += failed
        window = metrics()
        window.record("tools/latency_s", latency)
        window.record(f"tools/{call.name}/latency_s", latency)
        window.record(f"tools/{call.name}/call_count", 1, Reduce.SUM)
        window.record(f"tools/{call.name}/failure_count", int(failed), Reduce.SUM)
        messages.append(_message(call.name, content))
    return messages, failures
