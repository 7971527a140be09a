"""Agents without a server: tool-call parsing, schemas, running calls, environments, the tool loop on
scripted turns, and multi-turn reconciliation with the real tiny tokenizer and templates."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest

from asyncgrpo import AsyncGRPOConfig
from asyncgrpo.cli.tiny_model import build_tokenizer
from asyncgrpo.metrics import MetricsWindow
from asyncgrpo.rollout.agent import record_tool_rollout_metrics, run_tool_loop, turn_text
from asyncgrpo.rollout.chat import (
    QWEN3_TRAINING_TEMPLATE,
    RewriteDetector,
    render_prompt_ids,
    tool_schema,
    use_training_template,
)
from asyncgrpo.rollout.environments import (
    EnvironmentPool,
    environment_reward_sources,
    environment_tools,
    prompt_with_observation,
)
from asyncgrpo.rollout.rollout_metrics import record_rollout_metrics
from asyncgrpo.rollout.sequences import build_training_sequences
from asyncgrpo.rollout.tool_calls import parse_tool_calls, parse_turn, split_reasoning, tool_call_format
from asyncgrpo.rollout.tools import run_tool_calls
from asyncgrpo.rollout.types import Rollout, TurnRecord


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


# -- parsing -----------------------------------------------------------------------------------------------


def test_hermes_calls_are_read_in_order_and_removed_from_content():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>{"name": "neg", "arguments": "{\\"x\\": 3}"}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me add."
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("add", {"a": 1, "b": 2}, None),
        ("neg", {"x": 3}, None),
    ]


def test_malformed_calls_are_kept_with_a_reason():
    _, calls = parse_tool_calls(
        '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call><tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call><tool_call>{"name": "cut"'
    )
    assert [c.name for c in calls] == [None, None, "f", None]
    assert all(c.error for c in calls)
    assert "not valid JSON" in calls[0].error and '"name"' in calls[1].error and "object" in calls[2].error


def test_mistral_format():
    content, calls = parse_tool_calls('ok[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]', "mistral")
    assert content == "ok" and calls[0].name == "add" and calls[0].arguments == {"a": 1}


def test_xml_format_of_qwen3_5_is_read_in_order():
    text = (
        "I will call.\n\n<tool_call>\n<function=multiply>\n<parameter=a>\n2\n</parameter>\n"
        "<parameter=b>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=greet>\n"
        "<parameter=name>\nAda\nLovelace\n</parameter>\n</function>\n</tool_call>"
        "<tool_call>\n<parameter=x>\n1\n</parameter>\n</tool_call>"
    )
    content, calls = parse_tool_calls(text, "xml")
    assert content == "I will call."
    assert [(c.name, c.arguments, c.text_arguments) for c in calls[:2]] == [
        ("multiply", {"a": "2", "b": "3"}, True),
        ("greet", {"name": "Ada\nLovelace"}, True),
    ]
    assert calls[2].name is None and "<function=NAME>" in calls[2].error


def test_llama3_json_format_is_one_bare_object():
    content, calls = parse_tool_calls(' {"name": "add", "parameters": {"a": 1}}', "llama3_json")
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("add", {"a": 1})]
    assert parse_tool_calls("The answer is {a}.", "llama3_json") == ("The answer is {a}.", [])
    _, (broken,) = parse_tool_calls('{"name": "add", "parameters": {"a": ', "llama3_json")
    assert broken.name is None and "not valid JSON" in broken.error


# Excerpts of what each family's template declares (the parts the format and family are read by).
QWEN3_5_LIKE = (
    "{%- set ns = namespace(last_query_index=0) %}{{ reasoning_content }}"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>"
)
MISTRAL_LIKE = "{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}"
LLAMA3_LIKE = (
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and '
    "its value}.' }}"
)


def test_call_format_is_the_one_the_template_declares():
    assert tool_call_format(QWEN3_TRAINING_TEMPLATE) == "hermes"
    assert tool_call_format(QWEN3_5_LIKE) == "xml"
    assert tool_call_format(MISTRAL_LIKE) == "mistral"
    assert tool_call_format(LLAMA3_LIKE) == "llama3_json"
    assert tool_call_format(None) == "hermes"


def test_reasoning_is_split_like_parse_response():
    assert split_reasoning("<think>\nhmm\n</think>\n\n42") == ("hmm", "42")
    assert split_reasoning("hmm</think>42") == ("hmm", "42")  # opening tag in the generation prompt
    assert split_reasoning("<think>cut off") == (None, "<think>cut off")
    parsed = parse_turn(
        '<think>a</think><tool_call>{"name": "f", "arguments": {}}</tool_call>', "hermes", True, True
    )
    assert parsed.reasoning == "a" and parsed.content == "" and parsed.calls[0].name == "f"
    kept = parse_turn("<think>a</think>b", "hermes", False, reasoning=False)
    assert kept.reasoning is None and kept.content == "<think>a</think>b"


# -- schemas and rendering ---------------------------------------------------------------------------------


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def undocumented(step: int, label: str = "x") -> str:
    return label * step


class Counter:
    def reset(self, **kwargs):
        self.value = 0

    def get_reward(self) -> float:
        return float(self.value)

    def increment(self, step: int) -> int:
        """
        Increment the counter.

        Args:
            step: Value to add.
        """
        self.value += step
        return self.value

    def _private(self):
        return None


def test_schemas_from_docstrings_with_a_plain_fallback():
    schema = tool_schema(multiply)["function"]
    assert schema["name"] == "multiply" and schema["description"] == "Multiplies two integers."
    assert schema["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first integer."}
    plain = tool_schema(undocumented)["function"]
    assert plain["parameters"] == {
        "type": "object",
        "properties": {"step": {"type": "integer"}, "label": {"type": "string"}},
        "required": ["step"],
    }
    bound = tool_schema(Counter().increment)["function"]
    assert bound["name"] == "increment" and list(bound["parameters"]["properties"]) == ["step"]


def test_environment_tools_are_public_methods_only():
    assert [tool.__name__ for tool in environment_tools(Counter())] == ["increment"]


def test_render_prompt_ids_offers_the_tools(tokenizer):
    ids = render_prompt_ids(tokenizer, [{"role": "user", "content": "hi"}], [multiply])
    text = tokenizer.decode(ids)
    assert '"name": "multiply"' in text and text.endswith("<|im_start|>assistant\n")
    assert render_prompt_ids(tokenizer, [{"role": "user", "content": "hi"}]) == list(
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)[
            "input_ids"
        ]
    )


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


class ScriptedLoop:
    """Just what run_tool_loop uses of AsyncRolloutLoop, with turns read from a script: the model's
    replies are the input under test here, not the server."""

    def __init__(self, tokenizer, replies: dict[str, list[str]], **config):
        self.config = AsyncGRPOConfig(output_dir="unused", report_to="none", **config)
        self.tokenizer = tokenizer
        self.replies = replies
        self.metrics = MetricsWindow()
        self.max_model_len = 4096
        self.tool_executor = ThreadPoolExecutor(4)

    def render_prompt(self, prompt, tools, group_id):
        return render_prompt_ids(self.tokenizer, prompt, tools)

    async def generate_one_turn(self, prompt_ids):
        await asyncio.sleep(0.01)
        key = self.tokenizer.decode(prompt_ids).split("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
        reply = self.replies[key].pop(0)
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return TurnRecord(prompt_ids=list(prompt_ids), output_ids=ids, output_log_probs=[-1.0] * len(ids))


def call(name: str, **arguments) -> str:
    import json

    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


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
    from asyncgrpo.rollout.scheduler import RolloutScheduler
    from asyncgrpo.rollout.scoring import call_reward_functions

    config = AsyncGRPOConfig(output_dir="unused", report_to="none", max_concurrent_rollouts=2)
    loop = AsyncRolloutLoop(config, "m", [], [slow_judge], tokenizer, [0], channels=None)
    scheduler = RolloutScheduler(loop)
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
            tool_call = run_tool_calls(calls, [multiply], loop.tool_executor, lambda: MetricsWindow())
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
    # parse_reasoning: the message shape of TRL's parse_response (tests/test_reasoning_content.py: default).
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


# -- reconciliation with real templates ----------------------------------------------------------------------

# A Qwen3-style template: earlier assistant turns lose their <think> block once a later user turn exists.
REWRITING_TEMPLATE = QWEN3_TRAINING_TEMPLATE.replace(
    "{%- set content = message.content if message.content is string else '' %}",
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if not loop.last and '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}",
).replace("last_query_index", "")


def assert_each_generated_token_trained_once(turns, sequences):
    trained = [int(s.trained.sum()) for s in sequences]
    assert sum(trained) == sum(len(turn.output_ids) for turn in turns)
    # And the trained tokens are exactly the turns' outputs, in order.
    trained_ids = np.concatenate([s.token_ids[s.trained] for s in sequences]).tolist()
    assert trained_ids == [token for turn in turns for token in turn.output_ids]


def conversation_turns(tokenizer, replies: list[str], tools=(multiply,)):
    """Turns as the tool loop builds them: render, sample (the scripted reply), append, run tools."""
    conversation = [{"role": "user", "content": "start"}]
    turns = []
    for reply in replies:
        prompt_ids = render_prompt_ids(tokenizer, conversation, list(tools))
        output = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        turns.append(
            TurnRecord(prompt_ids=prompt_ids, output_ids=output, output_log_probs=[-1.0] * len(output))
        )
        conversation += [
            {"role": "assistant", "content": reply},
            {"role": "tool", "name": "multiply", "content": "6"},
        ]
    return turns


def test_prefix_preserving_template_extends_one_sample(tokenizer):
    turns = conversation_turns(tokenizer, ["<think>a</think>" + call("multiply", a=2, b=3)] * 2 + ["six"])
    sequences, stats = build_training_sequences(turns)
    assert len(sequences) == 1 and stats.transitions == 2 and stats.forks == 0
    assert_each_generated_token_trained_once(turns, sequences)


def test_a_history_rewriting_template_forks_and_still_trains_each_token_once(tokenizer):
    rewriting = build_tokenizer()
    rewriting.chat_template = REWRITING_TEMPLATE
    turns = conversation_turns(rewriting, ["<think>a</think>" + call("multiply", a=2, b=3)] * 2 + ["six"])
    sequences, stats = build_training_sequences(turns)
    assert stats.transitions == 2 and stats.forks == 2 and len(sequences) == 3
    assert all(drift > 0 for drift in stats.drift_tokens)
    assert_each_generated_token_trained_once(turns, sequences)


def test_a_fork_then_an_extension_trains_each_token_once():
    # Turn 2 re-renders turn 1's output differently (a fork); turn 3 extends turn 2's sample.
    turns = [
        TurnRecord(prompt_ids=[1, 2], output_ids=[3, 4], output_log_probs=[-0.1, -0.2]),
        TurnRecord(prompt_ids=[1, 2, 30, 4, 9], output_ids=[5], output_log_probs=[-0.3]),
        TurnRecord(prompt_ids=[1, 2, 30, 4, 9, 5, 8], output_ids=[6, 7], output_log_probs=[-0.4, -0.5]),
    ]
    sequences, stats = build_training_sequences(turns)
    assert [s.token_ids.tolist() for s in sequences] == [[1, 2, 3, 4], [1, 2, 30, 4, 9, 5, 8, 6, 7]]
    assert [s.trained.astype(int).tolist() for s in sequences] == [
        [0, 0, 1, 1],
        [0, 0, 0, 0, 0, 1, 0, 1, 1],
    ]
    assert [s.sampler_logprobs.tolist() for s in sequences] == [
        pytest.approx([-0.1, -0.2]),
        pytest.approx([-0.3, -0.4, -0.5]),
    ]
    assert stats.transitions == 2 and stats.forks == 1 and stats.drift_tokens == [2, 0]
    assert_each_generated_token_trained_once(turns, sequences)
    # The rollout's reconciliation metrics, by hand: 1 fork in 2 transitions, drifts 2 and 0,
    # 2 samples, 3 turns.
    window = MetricsWindow()
    rollout = Rollout(completion=[], completion_ids=[], turns=turns)
    record_rollout_metrics(window, rollout, 1.0, len(sequences), stats, eos_token_ids=[7])
    summary = window.summarize()
    assert summary["rollout/fork_frac"] == 0.5 and summary["rollout/samples_per_rollout"] == 2
    assert summary["rollout/drift_tokens_mean"] == 1.0 and summary["rollout/drift_tokens_max"] == 2
    assert summary["rollout/turns_mean"] == 3 and summary["rollout/turns_max"] == 3


def test_an_unknown_template_that_rewrites_history_is_reported_once(caplog):
    detector = RewriteDetector()
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.rollout.chat"):
        detector.observe(transitions=2, forks=0)
        assert not caplog.records, "no fork, no warning"
        detector.observe(transitions=2, forks=2)
        detector.observe(transitions=3, forks=1)
    assert len(caplog.records) == 1 and "rollout/fork_frac" in caplog.records[0].getMessage()


def test_known_qwen3_template_is_replaced_by_the_training_template():
    qwen3 = build_tokenizer()
    qwen3.chat_template = "{%- set last_query_index = 0 %}<tool_call>{{ reasoning_content }}"
    assert use_training_template(qwen3) and qwen3.chat_template == QWEN3_TRAINING_TEMPLATE
    other = build_tokenizer()
    assert not use_training_template(other)
    # Qwen3.5 also drops earlier reasoning, but its calls are <function=...> blocks: the Qwen3
    # training template would teach it another format, so its own template stays.
    qwen3_5 = build_tokenizer()
    qwen3_5.chat_template = QWEN3_5_LIKE
    assert not use_training_template(qwen3_5) and qwen3_5.chat_template == QWEN3_5_LIKE


# -- environments ------------------------------------------------------------------------------------------


class Slot:
    created = 0

    def __init__(self):
        Slot.created += 1

    def reset(self, task: str, **kwargs) -> str:
        self.task = task
        self.columns = kwargs
        return f"Do {task}."

    async def get_reward(self) -> float:
        return 1.0


def test_environment_pool_reuses_instances_and_drops_the_routing_column():
    window = MetricsWindow()
    Slot.created = 0

    async def episodes():
        pool = EnvironmentPool({"slot": Slot}, ThreadPoolExecutor(2), lambda: window)
        row = {"environment": "slot", "task": "x", "extra": 1}
        rewards = []
        for _ in range(3):
            async with pool.episode(row) as episode:
                assert episode.prompt == [{"role": "user", "content": "Do x."}]
                assert episode.instance.columns == {"extra": 1}
                rewards.append(await pool.reward(episode.instance))
        with pytest.raises(ValueError, match="routes to environment 'game'"):
            async with pool.episode({"environment": "game"}):
                pass
        return rewards

    rewards = asyncio.run(episodes())
    assert Slot.created == 1 and rewards == [(Slot, 1.0)] * 3
    stats = window.summarize()
    assert stats["env/reset_s"] >= 0 and stats["env/reward_s"] >= 0


def test_concurrent_episodes_each_hold_their_own_instance():
    Slot.created = 0

    async def episodes():
        pool = EnvironmentPool(Slot, ThreadPoolExecutor(2), lambda: MetricsWindow())
        held = []

        async def one(task):
            async with pool.episode({"task": task}) as episode:
                held.append(episode.instance)
                await asyncio.sleep(0.05)  # both episodes run at once
                return episode.instance.task

        tasks = await asyncio.gather(one("a"), one("b"))
        async with pool.episode({"task": "c"}) as episode:  # later: a reused instance
            reused = episode.instance
        return tasks, held, reused

    tasks, held, reused = asyncio.run(episodes())
    assert tasks == ["a", "b"], "an instance is never shared by two running rollouts"
    assert held[0] is not held[1] and Slot.created == 2 and any(reused is h for h in held)


class RowTargetEnv:
    """The documentation's dataset-backed IncrementEnv: reset reads its task from the row's columns."""

    def reset(self, target, **kwargs) -> None:  # the row's `target` column arrives as a keyword argument
        self.counter = 0
        self.target = target

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:  # no docstring: offered with its typed parameters
        self.counter += step
        return self.counter


def test_dataset_backed_environment_reads_its_task_from_the_row():
    from datasets import Dataset

    from asyncgrpo.trainer.checks import check_agent_inputs, check_conversational

    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"Increment the counter to {i}."}] for i in range(1, 7)],
            "target": list(range(1, 7)),
        }
    )
    args = SimpleNamespace(max_steps=-1)  # epochs end training: the dataset owns the data
    check_agent_inputs([], dataset, [], RowTargetEnv, args)  # get_reward is the only reward source
    check_conversational(dataset, RowTargetEnv)
    row = dataset[2]

    async def episode():
        pool = EnvironmentPool(RowTargetEnv, ThreadPoolExecutor(1), lambda: MetricsWindow())
        async with pool.episode(row) as episode:
            episode.tools[0](step=3)
            return episode, await pool.reward(episode.instance)

    episode, reward = asyncio.run(episode())
    assert episode.prompt == row["prompt"], "reset() returned None: the row's prompt is the prompt"
    assert episode.instance.target == 3 and [tool.__name__ for tool in episode.tools] == ["increment"]
    assert reward == (RowTargetEnv, 1.0)


def test_reset_string_with_and_without_a_dataset_prompt():
    assert prompt_with_observation(None, "hi") == [{"role": "user", "content": "hi"}]
    assert prompt_with_observation([{"role": "user", "content": "a"}], "b") == [
        {"role": "user", "content": "a\n\nb"}
    ]
    with pytest.raises(ValueError, match="reset\\(\\) must return"):
        prompt_with_observation(None, None)


def test_environment_rewards_are_one_source_per_class():
    names, sources = environment_reward_sources([(Slot, 1.0), None, (Counter, 2.0)])
    assert names == ["Slot", "Counter"] and sources == [[1.0, None, None], [None, None, 2.0]]


def test_agent_inputs_are_checked_at_construction():
    from asyncgrpo.trainer.checks import check_agent_inputs

    args = SimpleNamespace(max_steps=-1)
    with pytest.raises(ValueError, match="set max_steps"):
        check_agent_inputs([], None, [], Counter, args)
    with pytest.raises(ValueError, match="reward_funcs is empty"):
        check_agent_inputs([], None, [multiply], None, args)
    with pytest.raises(ValueError, match="'environment' column"):
        check_agent_inputs([], None, [], {"a": Counter}, SimpleNamespace(max_steps=5))
    with pytest.raises(ValueError, match="share the name"):
        check_agent_inputs([multiply], None, [multiply, multiply], Counter, SimpleNamespace(max_steps=5))
    check_agent_inputs([], None, [], Counter, SimpleNamespace(max_steps=5))
