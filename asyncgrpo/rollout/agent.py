"""The default `generate_one`: a multi-turn tool loop.

Each turn renders the whole conversation with the chat template (tools' schemas included), samples
one assistant turn, and runs the tool calls it contains; the results join the conversation as tool
messages and the next turn starts, until a turn calls no tool or `max_tool_calling_iterations` tool
turns have run. Every sampling request is one TurnRecord: the trainer builds its samples from them
(rollout/sequences.py), so only sampled tokens are trained; tool results and template tokens are
context.

Two views of the conversation are kept. The one that is re-rendered holds each assistant turn's text
verbatim, so a prefix-preserving template reproduces exactly the tokens that were sampled and the
next turn extends the same sample; its tool messages also carry a `tool_call_id` (Mistral's templates
require one). The one reward functions get (`completion`) is structured the way
TRL's is: content as generated less the tool-call blocks (its `<think>` block too, moved to
`reasoning_content`, when `parse_reasoning` is on), `tool_calls` as {"type": "function", "function":
{"name", "arguments"}}, and one {"role": "tool", "name", "content"} message per call.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Protocol

from asyncgrpo.records.metrics import MetricsWindow, Reduce
from asyncgrpo.rollout.chat import render_prompt_ids, tool_name, tool_schema
from asyncgrpo.rollout.context import HookContext
from asyncgrpo.rollout.settings import RolloutSettings
from asyncgrpo.rollout.tool_calls import (
    FORMAT_MARKERS,
    REASONING_MARKERS,
    ToolCall,
    parse_turn,
    require_call_format,
    tool_call_format,
    typed_arguments,
)
from asyncgrpo.rollout.tools import run_tool_calls
from asyncgrpo.rollout.types import Rollout, TurnRecord


class ToolLoopHost(Protocol):
    """What the tool loop uses of the rollout loop that runs it (an AsyncRolloutLoop)."""

    settings: RolloutSettings
    tokenizer: Any
    context: HookContext
    metrics: MetricsWindow

    def render_prompt(
        self, prompt: list[dict[str, Any]], tools: list[Callable], group_id: int
    ) -> list[int]: ...

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord: ...


@functools.lru_cache(maxsize=8)
def _format_of(template: str) -> str | None:
    return tool_call_format(template)


# tokenizer -> {(call format, vocabulary size): its kept special ids}. Looking the markers up costs
# several tokenizer calls per turn; the answer changes only when tokens are added to the tokenizer.
_kept_special_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _kept_special_ids(tokenizer, fmt: str) -> frozenset[int]:
    """The ids of the call format's and reasoning markers that are special tokens (which plain
    `skip_special_tokens` decoding would drop)."""
    try:
        by_format = _kept_special_cache.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that takes no weak reference: look the markers up every time
        by_format = {}
    key = (fmt, len(tokenizer))
    if key not in by_format:
        special = set()
        for marker in (*FORMAT_MARKERS.get(fmt, ()), *REASONING_MARKERS):
            ids = tokenizer.convert_tokens_to_ids([marker])
            if ids and ids[0] is not None and ids[0] != tokenizer.unk_token_id:
                if tokenizer.decode(ids, skip_special_tokens=True) == "":
                    special.add(ids[0])
        by_format[key] = frozenset(special)
    return by_format[key]


def turn_text(tokenizer, output_ids: list[int], fmt: str) -> str:
    """The sampled turn's text without special tokens (the end-of-turn token among them), except
    the markers the call format is read by: Mistral's `[TOOL_CALLS]` is a special token, so plain
    `skip_special_tokens` decoding would hide every call."""
    special = _kept_special_ids(tokenizer, fmt)
    if not special.intersection(output_ids):
        return tokenizer.decode(output_ids, skip_special_tokens=True)
    pieces, segment = [], []
    for token in output_ids:
        if token in special:
            pieces += [
                tokenizer.decode(segment, skip_special_tokens=True),
                tokenizer.convert_ids_to_tokens(token),
            ]
            segment = []
        else:
            segment.append(token)
    return "".join([*pieces, tokenizer.decode(segment, skip_special_tokens=True)])


def type_text_arguments(calls: list[ToolCall], tools: list[Callable]) -> None:
    """Convert the text arguments of xml- and glm45-format calls to their tools' schema types, in place."""
    by_name = {tool_name(tool): tool for tool in tools}
    for call in calls:
        if call.text_arguments and call.name in by_name:
            parameters = tool_schema(by_name[call.name])["function"].get("parameters", {})
            call.arguments = typed_arguments(call.arguments, parameters.get("properties", {}))
            call.text_arguments = False


def tool_call_id(call: ToolCall, number: int) -> str:
    """The id a tool message names its call by: the one the model wrote, when it is the 9
    alphanumeric characters Mistral's templates require, else `call` and the call's number in the
    rollout (templates that show no ids ignore it)."""
    if call.id is not None and len(call.id) == 9 and call.id.isalnum():
        return call.id
    return f"call{number:05d}"


def assistant_message(text: str, parsed) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.calls:
        message["tool_calls"] = [call.as_message_entry() for call in parsed.calls if call.error is None]
    return message


async def run_tool_loop(
    loop: ToolLoopHost, prompt: list[dict[str, Any]], tools: list[Callable], group_id: int
) -> Rollout:
    sampling, context = loop.settings.sampling, loop.context
    template = loop.tokenizer.chat_template if isinstance(loop.tokenizer.chat_template, str) else ""
    fmt = _format_of(template)
    if tools and fmt is None:  # the trainer refuses this at start; a custom loop may still get here
        require_call_format(template, getattr(loop, "model_name", "the model"))
    limit = loop.settings.tools.max_tool_calling_iterations
    conversation = [dict(message) for message in prompt]
    completion: list[dict[str, Any]] = []
    turns = []
    calls = failures = tool_turns = 0
    exhausted = False
    prompt_ids = loop.render_prompt(prompt, tools, group_id)
    while True:
        turn = await loop.generate_one_turn(prompt_ids)
        turns.append(turn)
        text = turn_text(loop.tokenizer, turn.output_ids, fmt)
        parsed = parse_turn(text, fmt, with_tools=bool(tools), reasoning=sampling.parse_reasoning)
        type_text_arguments(parsed.calls, tools)
        completion.append(assistant_message(text, parsed))
        conversation.append({"role": "assistant", "content": text})
        if not parsed.calls:
            break
        if limit is not None and tool_turns >= limit:
            exhausted = True
            break
        results, failed = await run_tool_calls(
            parsed.calls,
            tools,
            context.tool_executor,
            lambda: loop.metrics,
            timeout_s=loop.settings.tools.tool_timeout,
            activity=context.activity,
        )
        tool_turns += 1
        completion.extend(results)
        conversation.extend(
            {**result, "tool_call_id": tool_call_id(call, calls + number)}
            for number, (call, result) in enumerate(zip(parsed.calls, results), start=1)
        )
        calls += len(parsed.calls)
        failures += failed
        prompt_ids = render_prompt_ids(loop.tokenizer, conversation, tools, sampling.chat_template_kwargs)
        if len(prompt_ids) >= context.max_model_len:
            break  # no room left to answer the tool results: the rollout ends here, clipped
    if tools:
        loop.metrics.record("tools/loop_exhausted_frac", float(exhausted))
    return Rollout(
        completion=completion,
        completion_ids=[token for turn in turns for token in turn.output_ids],
        turns=turns,
        tool_call_count=calls,
        tool_failure_count=failures,
    )


def record_tool_rollout_metrics(metrics: MetricsWindow, rollout: Rollout) -> None:
    """Per-rollout tool metrics, from the Rollout's counts (so an overridden generate_one gets them)."""
    metrics.record("tools/call_frequency", rollout.tool_call_count)
    # Unknown names are counted as they happen (rollout/tools.py); a 0 here keeps the count logged
    # (as 0) in windows without any, like the other tools/* metrics.
    metrics.record("tools/unknown_name_count", 0, Reduce.SUM)
    # failures over calls, as a weighted mean: NaN in a window without any call (not 0.0).
    calls = rollout.tool_call_count
    metrics.record(
        "tools/failure_frequency", rollout.tool_failure_count / calls if calls else 0.0, weight=calls
    )
