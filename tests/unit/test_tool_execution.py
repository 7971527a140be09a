"""Running tool calls and the tool loop around them, without a server: failures answered as messages
and counted, the calls of one turn run in the order emitted, tool metrics by hand, and the loop on
scripted model turns (a slow tool or a slow reward function holds back nothing else, the limit on
iterations, TRL-style completions, schema types for XML calls, call markers that are special tokens)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from agent_fakes import ScriptedLoop, assert_each_generated_token_trained_once, call, multiply

from asyncgrpo import AsyncGRPOConfig
from asyncgrpo.cli.tiny_model import build_tokenizer
from asyncgrpo.records.metrics import MetricsWindow
from asyncgrpo.rollout.activity import ActivityBoard
from asyncgrpo.rollout.agent import record_tool_rollout_metrics, run_tool_loop, turn_text
from asyncgrpo.rollout.sequences import build_training_sequences
from asyncgrpo.rollout.tool_calls import parse_tool_calls
from asyncgrpo.rollout.tools import run_tool_calls
from asyncgrpo.rollout.training_templates import QWEN3_TRAINING_TEMPLATE
from asyncgrpo.rollout.types import Rollout

# -- running calls -----------------------------------------------------------------------------------------


def explode(x: int) -> int:
    """
    Always fails.

    Args:
        x: Ignored.
    """
    raise RuntimeError("boom")


async def async_add(a: int, b: int) -> int:
    """
    Adds.

    Args:
        a: First.
        b: Second.
    """
    await asyncio.sleep(0)
    return a + b


def test_failures_become_messages_and_counts():
    window = MetricsWindow()
    _, calls = parse_tool_calls(
        '<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>'
        '<tool_call>{"name": "explode", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "multiply", "arguments": {"a": </tool_call>'
        '<tool_call>{"name": "async_add", "arguments": {"a": 2, "b": 5}}</tool_call>'
    )
    with ThreadPoolExecutor(2) as executor:
        messages, failures = asyncio.run(
            run_tool_calls(calls, [multiply, explode, async_add], executor, lambda: window)
        )
    assert [m["content"] for m in messages][0] == "6" and messages[-1]["content"] == "7"
    assert messages[1]["content"] == "Error: RuntimeError: boom"
    assert "no tool named 'nope'" in messages[2]["content"] and "not valid JSON" in messages[3]["content"]
    assert failures == 3
    stats = window.summarize()
    assert stats["tools/unknown_name_count"] == 1 and stats["tools/parallel_calls_mean"] == 5
    assert stats["tools/multiply/call_count"] == 1 and stats["tools/explode/failure_count"] == 1
    assert stats["tools/async_add/call_count"] == 1 and "tools/nope/call_count" not in stats


def test_a_tools_latency_is_its_own_time():
    window = MetricsWindow()
    _, calls = parse_tool_calls('<tool_call>{"name": "nap", "arguments": {"seconds": 0.2}}</tool_call>')
    with ThreadPoolExecutor(1) as executor:
        asyncio.run(run_tool_calls(calls * 2, [nap], executor, lambda: window))
    stats = window.summarize()
    assert (
        0.2 <= stats["tools/nap/latency_s"] < 1.0 and stats["tools/latency_s"] == stats["tools/nap/latency_s"]
    )


HANG = threading.Event()  # set at the end of the test that uses it, so the abandoned thread ends


def hang(x: int) -> int:
    """
    Never returns by itself.

    Args:
        x: Ignored.
    """
    HANG.wait()
    return x


async def hang_async(x: int) -> int:
    """
    Never returns by itself, async.

    Args:
        x: Ignored.
    """
    await asyncio.Event().wait()
    return x


def test_a_tool_past_tool_timeout_becomes_an_error_the_model_sees_and_is_counted():
    window = MetricsWindow()
    board = ActivityBoard()
    _, calls = parse_tool_calls(
        '<tool_call>{"name": "hang", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "hang_async", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>'
    )
    executor = ThreadPoolExecutor(2)
    try:
        messages, failures = asyncio.run(
            run_tool_calls(
                calls, [hang, hang_async, multiply], executor, lambda: window, timeout_s=0.2, activity=board
            )
        )
    finally:
        HANG.set()
        executor.shutdown(wait=True)
    timed_out = "Error: the tool did not return within tool_timeout=0.2 s"
    assert [m["content"] for m in messages] == [timed_out, timed_out, "6"]
    assert failures == 2 and board.describe() == ""
    stats = window.summarize()
    assert stats["tools/timeout_count"] == 2 and stats["tools/hang/failure_count"] == 1


def test_rollout_tool_frequencies_hand_values():
    # Rollouts with (calls, failures) (2, 1), (0, 0), (3, 0): 5 calls over 3 rollouts, 1 failure in 5.
    window = MetricsWindow()
    for calls, failures in [(2, 1), (0, 0), (3, 0)]:
        rollout = Rollout(
            completion=[], completion_ids=[], turns=[], tool_call_count=calls, tool_failure_count=failures
        )
        record_tool_rollout_metrics(window, rollout)
    stats = window.summarize()
    assert stats["tools/call_frequency"] == pytest.approx(5 / 3)
    assert stats["tools/failure_frequency"] == pytest.approx(1 / 5)
    assert stats["tools/unknown_name_count"] == 0, "logged as 0 in a window without unknown names"
    empty = MetricsWindow()
    record_tool_rollout_metrics(empty, Rollout(completion=[], completion_ids=[], turns=[]))
    assert np.isnan(empty.summarize()["tools/failure_frequency"]), "no call: no failure rate"


CALL_LOG: list[str] = []


def first_slow(x: int) -> int:
    """
    Slow, sync.

    Args:
        x: Logged.
    """
    time.sleep(0.3)
    CALL_LOG.append(f"first_slow({x})")
    return x


async def second_fast(x: int) -> int:
    """
    Fast, async.

    Args:
        x: Logged.
    """
    CALL_LOG.append(f"second_fast({x})")
    return x


def test_calls_of_one_turn_run_one_after_another_in_emitted_order():
    # Run at once, the async call would finish while the sync one sleeps: the log says which.
    CALL_LOG.clear()
    _, calls = parse_tool_calls(
        '<tool_call>{"name": "first_slow", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "second_fast", "arguments": {"x": 2}}</tool_call>'
        '<tool_call>{"name": "first_slow", "arguments": {"x": 3}}</tool_call>'
    )
    with ThreadPoolExecutor(4) as executor:
        messages, failures = asyncio.run(
            run_tool_calls(calls, [first_slow, second_fast], executor, lambda: MetricsWindow())
        )
    assert CALL_LOG == ["first_slow(1)", "second_fast(2)", "first_slow(3)"]
    assert [m["content"] for m in messages] == ["1", "2", "3"] and failures == 0


def nap(seconds: float) -> str:
    """
    Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "rested"


# -- the tool loop on scripted turns -------------------------------------------------------------------------


# Released by the test once the fast rollout has ended: the slow tool answers only after it, so the
# fast rollout must have run all its turns while the slow tool was busy (no timing involved).
SLOW_TOOL_RELEASE = threading.Event()


def slow_lookup(key: str) -> str:
    """
    A slow lookup.

    Args:
        key: What to look up.
    """
    if not SLOW_TOOL_RELEASE.wait(timeout=60):
        return "never released: the other rollout was held back"
    return key.upper()


def test_a_slow_tool_does_not_hold_back_other_rollouts(tokenizer):
    replies = {
        "slow": [call("slow_lookup", key="a"), "done"],
        "fast": [call("multiply", a=1, b=2)] * 5 + ["done"],
    }
    loop = ScriptedLoop(tokenizer, replies)
    tools = [slow_lookup, multiply]
    SLOW_TOOL_RELEASE.clear()

    async def rollout(key):
        result = await run_tool_loop(loop, [{"role": "user", "content": key}], tools, 0)
        if key == "fast":
            SLOW_TOOL_RELEASE.set()
        return result

    async def both():
        return await asyncio.gather(rollout("slow"), rollout("fast"))

    slow, fast = asyncio.run(both())
    assert fast.tool_call_count == 5 and len(fast.turns) == 6 and slow.tool_call_count == 1
    # The slow tool answered after the fast rollout's six turns had all ended.
    assert [m["content"] for m in slow.completion if m["role"] == "tool"] == ["A"]


def test_failed_calls_are_answered_and_the_rollout_goes_on(tokenizer):
    failing = (
        call("explode", x=1)
        + call("nope")
        + '<tool_call>{"name": "multiply", "arguments": {"a": </tool_call>'
        + call("multiply", a=2, b=3)
    )
    loop = ScriptedLoop(tokenizer, {"go": [failing, call("multiply", a=1, b=4), "done"]})
    rollout = asyncio.run(run_tool_loop(loop, [{"role": "user", "content": "go"}], [multiply, explode], 0))
    assert len(rollout.turns) == 3 and rollout.completion[-1]["content"] == "done"
    assert rollout.tool_call_count == 5 and rollout.tool_failure_count == 3
    answers = [m["content"] for m in rollout.completion if m["role"] == "tool"]
    assert answers[0] == "Error: RuntimeError: boom" and "no tool named 'nope'" in answers[1]
    assert "not valid JSON" in answers[2] and answers[3:] == ["6", "4"]
    # What the model read next: the errors are in the second turn's prompt.
    assert "no tool named 'nope'" in tokenizer.decode(rollout.turns[1].prompt_ids)
    record_tool_rollout_metrics(loop.metrics, rollout)
    stats = loop.metrics.summarize()
    assert stats["tools/failure_frequency"] == pytest.approx(3 / 5) and stats["tools/unknown_name_count"] == 1
    assert stats["tools/explode/failure_count"] == 1 and stats["tools/multiply/call_count"] == 2
    assert stats["tools/parallel_calls_mean"] == pytest.approx((4 + 1) / 2)


# Judges that hold their reward thread until released, counting how many hold one.
JUDGES_RELEASE = threading.Event()
JUDGES_HOLDING = threading.Semaphore(0)


def slow_judge(completions, **kwargs) -> list[float]:
    JUDGES_HOLDING.release()
    JUDGES_RELEASE.wait(timeout=60)
    return [0.0] * len(completions)


def test_slow_sync_reward_functions_do_not_take_the_tools_threads(tokenizer):
    # Two threads per pool; four groups scored at once by sync judges that hold both reward threads
    # until released. A tool call made meanwhile must answer before they are released (it queued
    # behind them when they shared one pool).
    from asyncgrpo import AsyncRolloutLoop
    from asyncgrpo.rollout.context import LoopInputs
    from asyncgrpo.rollout.prompts import StreamStart
    from asyncgrpo.rollout.scheduler import RolloutScheduler
    from asyncgrpo.rollout.scoring import call_reward_functions

    config = AsyncGRPOConfig(output_dir="unused", report_to="none", max_concurrent_rollouts=2)
    inputs = LoopInputs.of(config, model_name="m", processing_class=tokenizer, eos_token_ids=[0])
    scheduler = RolloutScheduler(AsyncRolloutLoop, inputs, channels=None, stream=StreamStart())
    scheduler._make_thread_pools()
    _, calls = parse_tool_calls('<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>')
    JUDGES_RELEASE.clear()

    async def scoring_and_a_tool_call():
        scoring = [
            call_reward_functions([slow_judge], scheduler._reward_executor, [[]], [[]], [[]], {})
            for _ in range(4)
        ]
        judged = asyncio.gather(*scoring)
        try:
            for _ in range(2):  # both reward threads are held by a judge now
                assert await asyncio.to_thread(JUDGES_HOLDING.acquire, timeout=60), "no judge started"
            tool_call = run_tool_calls(calls, [multiply], scheduler.tool_executor, lambda: MetricsWindow())
            messages, _ = await asyncio.wait_for(tool_call, timeout=30)
        finally:
            JUDGES_RELEASE.set()
        await judged
        return messages

    messages = asyncio.run(scoring_and_a_tool_call())
    assert messages[0]["content"] == "6"


def test_loop_stops_at_max_tool_calling_iterations_and_builds_trl_style_completions(tokenizer):
    replies = {
        "go": ["<think>plan</think>" + call("multiply", a=2, b=3), call("multiply", a=1, b=1), "never"]
    }
    # parse_reasoning: the message shape of TRL's parse_response (tests/unit/test_reasoning_content.py:
    # default).
    loop = ScriptedLoop(tokenizer, replies, max_tool_calling_iterations=1, parse_reasoning=True)
    rollout = asyncio.run(run_tool_loop(loop, [{"role": "user", "content": "go"}], [multiply], 0))
    assert len(rollout.turns) == 2 and rollout.tool_call_count == 1
    first, tool_message, last = rollout.completion
    assert first["reasoning_content"] == "plan" and first["content"] == ""
    assert first["tool_calls"] == [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 2, "b": 3}}}
    ]
    assert tool_message == {"role": "tool", "name": "multiply", "content": "6"}
    assert last["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 1}
    assert loop.metrics.summarize()["tools/loop_exhausted_frac"] == 1.0
    # The template re-renders the sampled turn verbatim: turn 2 extends the same sample.
    sequences, stats = build_training_sequences(rollout.turns)
    assert len(sequences) == 1 and stats.forks == 0
    assert_each_generated_token_trained_once(rollout.turns, sequences)


def greet(name: str, times: int, loud: bool) -> str:
    """
    Greets.

    Args:
        name: Who.
        times: How often.
        loud: Shout.
    """
    return ("HI " if loud else "hi ") * times + name


def test_xml_calls_get_their_schema_types_in_the_loop(tokenizer):
    xml = build_tokenizer()
    xml.chat_template = QWEN3_TRAINING_TEMPLATE + "{#- calls are <function=NAME> blocks #}"
    block = (
        "<tool_call>\n<function=greet>\n<parameter=name>\n007\n</parameter>\n<parameter=times>\n2\n"
        "</parameter>\n<parameter=loud>\nTrue\n</parameter>\n</function>\n</tool_call>"
    )
    loop = ScriptedLoop(xml, {"go": [block, "done"]})
    rollout = asyncio.run(run_tool_loop(loop, [{"role": "user", "content": "go"}], [greet], 0))
    assert rollout.tool_call_count == 1 and rollout.tool_failure_count == 0
    arguments = rollout.completion[0]["tool_calls"][0]["function"]["arguments"]
    assert arguments == {"name": "007", "times": 2, "loud": True}  # "007" stays text: name is a string
    assert rollout.completion[1]["content"] == "HI HI 007"


def test_a_call_marker_that_is_a_special_token_survives_decoding(tokenizer):
    # Mistral's [TOOL_CALLS] is a special token: decoding with skip_special_tokens alone drops it.
    mistral = build_tokenizer()
    mistral.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    mistral.chat_template = QWEN3_TRAINING_TEMPLATE.replace("<tool_call>", "[TOOL_CALLS]")
    reply = 'ok[TOOL_CALLS][{"name": "multiply", "arguments": {"a": 2, "b": 3}}]'
    ids = mistral.encode(reply, add_special_tokens=False) + [mistral.eos_token_id]
    assert (
        mistral.decode(ids, skip_special_tokens=True)
        == 'ok[{"name": "multiply", "arguments": {"a": 2, "b": 3}}]'
    )
    assert turn_text(mistral, ids, "mistral") == reply
    assert turn_text(mistral, ids, "hermes") == mistral.decode(ids, skip_special_tokens=True)
    loop = ScriptedLoop(mistral, {"go": [reply, "done"]})
    rollout = asyncio.run(run_tool_loop(loop, [{"role": "user", "content": "go"}], [multiply], 0))
    assert rollout.tool_call_count == 1 and rollout.completion[1]["content"] == "6"
    assert rollout.completion[0]["content"] == "ok"


def test_a_marker_added_after_a_first_turn_is_kept_too():
    # turn_text remembers which markers are special tokens per tokenizer; adding one must not leave
    # that memory stale.
    tokenizer = build_tokenizer()
    reply = 'ok[TOOL_CALLS][{"name": "multiply", "arguments": {"a": 2, "b": 3}}]'
    assert turn_text(tokenizer, tokenizer.encode(reply, add_special_tokens=False), "mistral") == reply
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    ids = tokenizer.encode(reply, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) != reply  # the marker is special now
    assert turn_text(tokenizer, ids, "mistral") == reply
