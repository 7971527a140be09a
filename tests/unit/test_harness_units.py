"""The harness's parts without a server: the capture contract (a captured turn to a TrainingTrace
and back), turns sampled under several policy versions chained into one sample, the capture
proxy's size cap and its thread pool (sampling stubbed), the tool metrics, and
ProcessSessionFactory's sessions (task.json, environment, timeout, cleanup of the process group)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support_paths import SUPPORT

pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402

from asyncgrpo.harness import (  # noqa: E402
    CaptureContractError,
    ProcessSessionFactory,
    ToolResult,
    ToolTraceEntry,
    TrainingTrace,
    capture,
)
from asyncgrpo.harness.agent_sandbox import AgentSandbox  # noqa: E402
from asyncgrpo.harness.capture import CaptureProxy  # noqa: E402
from asyncgrpo.harness.openai_chat import template_messages  # noqa: E402
from asyncgrpo.harness.tool_metrics import captured_tool_calls, white_box_tool_calls  # noqa: E402
from asyncgrpo.harness.trace import training_turn, turns_from_trace  # noqa: E402
from asyncgrpo.records.metrics import MetricsWindow  # noqa: E402
from asyncgrpo.rollout.sequences import build_training_sequences  # noqa: E402
from asyncgrpo.rollout.types import TurnRecord  # noqa: E402


def sampled(prompt, output, version, width=2):
    logprobs = [-0.5 - 0.1 * i for i in range(len(output))]
    top_ids = np.array([[token, token + 1][:width] for token in output], dtype=np.int64)
    top_logprobs = np.array([[lp, lp - 1.0][:width] for lp in logprobs], dtype=np.float32)
    return TurnRecord(
        prompt,
        output,
        logprobs,
        output_top_ids=top_ids,
        output_top_logprobs=top_logprobs,
        finish_reason="stop",
        model_version=version,
    )


def test_a_session_spanning_a_weight_sync_keeps_each_turns_version_and_log_probs():
    first = sampled([1, 2, 3], [10, 11], version=3)
    second = sampled([1, 2, 3, 10, 11, 4, 5], [12, 13, 14], version=4)  # extends the first turn exactly
    trace = TrainingTrace(turns=[training_turn(t, f"e-{i}", {}, {}) for i, t in enumerate([first, second])])
    turns = turns_from_trace(trace, default_version=0, top_n=2)
    assert [turn.model_version for turn in turns] == [3, 4]
    assert [turn.output_ids for turn in turns] == [[10, 11], [12, 13, 14]]
    np.testing.assert_array_equal(turns[1].output_top_ids, second.output_top_ids)
    (sequence,), stats = build_training_sequences(turns)
    assert stats.forks == 0
    assert sequence.token_ids.tolist() == [1, 2, 3, 10, 11, 4, 5, 12, 13, 14]
    assert sequence.trained.tolist() == [False] * 3 + [True] * 2 + [False] * 2 + [True] * 3
    # Each token keeps the log-prob of the version that sampled it; the sample counts as the oldest.
    np.testing.assert_allclose(sequence.sampler_logprobs, first.output_log_probs + second.output_log_probs)
    assert sequence.model_version == 3


def test_a_turn_without_a_recorded_version_counts_as_the_sessions_first():
    turn = training_turn(sampled([1, 2], [3], version=7), "e-0", {}, {})
    del turn.metadata["policy_version"]
    (record,) = turns_from_trace(TrainingTrace(turns=[turn]), default_version=5, top_n=0)
    assert record.model_version == 5


@pytest.mark.parametrize(
    "broken, message",
    [
        (TurnRecord([1, 2], [3, 4], [-0.1]), "breaks the capture contract"),  # ids and log-probs misaligned
        (TurnRecord([], [3], [-0.1]), "breaks the capture contract"),  # no prompt ids
        (TurnRecord([1], [3], [0.5]), "breaks the capture contract"),  # a positive log-prob
    ],
)
def test_a_capture_that_breaks_the_contract_is_refused(broken, message):
    with pytest.raises(CaptureContractError, match=message):
        training_turn(broken, "e-0", {}, {})


def test_a_trace_without_completion_ids_or_the_top_n_the_loss_needs_is_refused():
    empty = training_turn(TurnRecord([1, 2], [], []), "e-0", {}, {})
    with pytest.raises(CaptureContractError, match="0 completion ids"):
        turns_from_trace(TrainingTrace(turns=[empty]), 0, top_n=0)
    no_top = training_turn(TurnRecord([1, 2], [3], [-0.2]), "e-1", {}, {})
    assert turns_from_trace(TrainingTrace(turns=[no_top]), 0, top_n=0)[0].output_top_ids is None
    with pytest.raises(CaptureContractError, match="top-8"):
        turns_from_trace(TrainingTrace(turns=[no_top]), 0, top_n=8)


def test_the_agents_openai_history_is_made_renderable():
    messages = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "ok"},
    ]
    converted = template_messages(messages)
    assert converted[0]["content"] == "" and converted[0]["tool_calls"][0]["function"]["arguments"] == {
        "x": 1
    }
    assert messages[0]["content"] is None, "the agent's own messages are left as they were"


class FakeCapture:
    base_url, model, unix_socket = "http://127.0.0.1:1/v1", "tiny", None

    def __init__(self):
        self.open, self.closed = [], []

    def open_session(self, episode_id):
        self.open.append(episode_id)
        return f"key-{episode_id}"

    def close_session(self, key):
        self.closed.append(key)

    def training_trace(self, key):
        return TrainingTrace(turns=[])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(")")[-1].split()[0] == "Z")  # not a zombie


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, seen from outside: a sandboxed agent's pids are its own namespace's,
    so a test finds its processes from the session's supervisor down."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError):
            continue
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


AGENT_ECHO = """
import json, os, pathlib, sys
task = json.loads(sys.stdin.read())
pathlib.Path("seen.json").write_text(json.dumps({
    "stdin": task, "file": json.loads(pathlib.Path("task.json").read_text()),
    "env": [os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], os.environ["OPENAI_MODEL"]]}))
"""


def test_a_process_session_gets_its_task_and_the_proxys_address_and_is_scored_by_verify(
    tmp_path, monkeypatch
):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    seen = {}

    def verify(workdir: Path, transcript) -> float:
        seen.update(json.loads((workdir / "seen.json").read_text()))
        return 0.5

    capture = FakeCapture()
    factory = ProcessSessionFactory(
        [sys.executable, "-c", AGENT_ECHO],
        verify,
        agent_columns=["hint"],
        sampling={"temperature": 1.0},
        capture=capture,
    )
    row = {"prompt": [{"role": "user", "content": "hi"}], "hint": "a number", "answer": "42"}
    session = factory.create(row, seed=3, episode_id="ep")
    assert session.wait_for_completion() == 0
    assert session.verify([]).env_reward == 0.5
    session.close()
    # The prompt and the columns named for the agent; the answer stays with the trainer
    # (test_harness_safety.py).
    expected = {"prompt": row["prompt"], "hint": "a number", "seed": 3, "episode_id": "ep"}
    assert seen["stdin"] == seen["file"] == {**expected, "sampling": {"temperature": 1.0}}
    # The proxy as the sandboxed agent reaches it: the bridge in its own loopback.
    assert seen["env"] == [AgentSandbox.base_url, "key-ep", "tiny"]
    assert capture.closed == ["key-ep"] and not list(tmp_path.iterdir())


# A bound, not a wait: only a failing test reaches it.
KILL_DELIVERY_BOUND_S = 10.0

HANGING_PARENT = """
import subprocess, sys, time, pathlib
child = subprocess.Popen([sys.executable, "-c", "import threading; threading.Event().wait()"])
pathlib.Path("child.pid").write_text(str(child.pid))
import threading; threading.Event().wait()
"""


def started_processes(session, bound_s: float) -> list[int]:
    """The processes of a HANGING_PARENT agent, from its supervisor down, once its child has started
    (the pid the agent writes is its namespace's own: the sandbox's init, the agent, its child...)."""
    pid_file = session.workdir / "child.pid"
    assert wait_until(lambda: pid_file.exists() and pid_file.read_text(), bound_s)
    return descendants(session.process.pid)


@pytest.mark.parametrize("sandbox", ["bubblewrap", "none"])
def test_a_hanging_agent_is_ended_at_its_timeout_with_its_children_and_files(tmp_path, monkeypatch, sandbox):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    factory = ProcessSessionFactory(
        [sys.executable, "-c", HANGING_PARENT],
        lambda workdir, transcript: 1.0,
        timeout_s=0.5,
        capture=FakeCapture(),
        agent_sandbox=sandbox,
    )
    session = factory.create([{"role": "user", "content": "hi"}])
    processes = started_processes(session, START_BOUND_S)
    assert len(processes) >= 2, processes  # the agent and its child at least
    with pytest.raises(TimeoutError, match="timeout_s=0.5"):
        session.wait_for_completion()
    session.close()
    assert not pid_alive(session.process.pid)
    # The child was killed with the agent; it is gone once the kernel has delivered the signal.
    assert wait_until(lambda: not any(map(pid_alive, processes)), KILL_DELIVERY_BOUND_S)
    assert not list(tmp_path.iterdir())


def test_a_factory_needs_a_command_a_verify_and_the_trainers_capture():
    with pytest.raises(ValueError, match="command must be"):
        ProcessSessionFactory([], lambda w, t: 0.0)
    with pytest.raises(ValueError, match="verify must be"):
        ProcessSessionFactory(["true"], None)
    with pytest.raises(ValueError, match="no capture endpoint"):
        ProcessSessionFactory(["true"], lambda w, t: 0.0).create([])


# The rollout worker's part, in a stand-in process: a factory, one session started on a pool thread
# (that thread then exits, as pool threads may), the agent's pid printed, then it blocks until killed.
STAND_IN_WORKER = """
import sys, threading
sys.path[:0] = sys.argv[1:4]
from asyncgrpo.harness import ProcessSessionFactory
from test_harness_units import FakeCapture, HANGING_PARENT
agent = [sys.executable, "-c", HANGING_PARENT]
factory = ProcessSessionFactory(agent, lambda w, t: 1.0, capture=FakeCapture())
sessions = []
task = [{"role": "user", "content": "hi"}]
starter = threading.Thread(target=lambda: sessions.append(factory.create(task)))
starter.start()
starter.join()
print(sessions[0].process.pid, sessions[0].workdir, flush=True)
threading.Event().wait()
"""
# Bounds, not waits: only a failing test reaches them (a loaded machine starts a Python process in
# seconds, and the reaper acts once the kernel has closed the dead worker's pipe).
START_BOUND_S, REAP_BOUND_S = 120.0, 60.0


def wait_until(condition, bound_s: float) -> bool:
    deadline = time.monotonic() + bound_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_worker_killed_outright_takes_its_agents_and_their_children_with_it(tmp_path):
    tests = str(Path(__file__).resolve().parent)
    worker = subprocess.Popen(
        [sys.executable, "-c", STAND_IN_WORKER, tests, str(SUPPORT), str(Path(tests).parents[1])],
        stdout=subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        text=True,
    )
    try:
        supervisor, workdir = worker.stdout.readline().split()
        pid_file = Path(workdir) / "child.pid"
        assert wait_until(lambda: pid_file.exists() and pid_file.read_text(), START_BOUND_S)
        processes = [int(supervisor), *descendants(int(supervisor))]  # the sandbox, the agent, its child
        assert len(processes) >= 3 and all(map(pid_alive, processes))
        worker.kill()  # SIGKILL: no clean-up of the worker's own runs
        worker.wait()
        assert wait_until(lambda: not any(map(pid_alive, processes)), REAP_BOUND_S), (
            "the agent and its child outlived their rollout worker"
        )
    finally:
        worker.kill()
        worker.wait()


def test_a_closed_factory_ends_the_groups_its_sessions_left(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    factory = ProcessSessionFactory(
        [sys.executable, "-c", HANGING_PARENT], lambda w, t: 1.0, capture=FakeCapture()
    )
    session = factory.create([{"role": "user", "content": "hi"}])
    factory.close()  # the session was never closed: the reaper ends its group
    assert wait_until(lambda: not pid_alive(session.process.pid), REAP_BOUND_S)
    session.close()


def reply(*names):
    calls = [{"id": f"c{i}", "function": {"name": name, "arguments": "{}"}} for i, name in enumerate(names)]
    return {"choices": [{"message": {"role": "assistant", "content": "", "tool_calls": calls or None}}]}


def test_tool_metrics_of_a_captured_session_count_calls_per_tool_and_unoffered_names():
    offered = {"tools": [{"type": "function", "function": {"name": "write_file"}}]}
    entries = [
        {"request": offered, "response": reply("write_file", "rm")},  # 2 calls, "rm" never offered
        {"request": offered, "response": reply()},  # a reply without calls
        {"request": offered, "response": reply("write_file")},
    ]
    counts = captured_tool_calls(entries)
    # "rm" is a name the model made up: it is counted, under one name for every undeclared tool.
    assert counts.calls == {"write_file": 2, "undeclared": 1} and counts.total == 3
    assert counts.per_reply == [2, 1] and counts.unknown_names == 1 and counts.failures is None
    window = MetricsWindow()
    counts.record(window)
    counts.record(window)  # a second rollout, the same
    logged = window.summarize()
    assert logged["tools/call_frequency"] == 3.0  # per rollout
    assert logged["tools/parallel_calls_mean"] == 1.5  # (2 + 1) / 2 replies with calls
    assert logged["tools/unknown_name_count"] == 2.0
    assert logged["tools/write_file/call_count"] == 4.0 and logged["tools/undeclared/call_count"] == 2.0
    assert not [name for name in logged if "/rm/" in name], "a made-up name never becomes a metric name"
    assert not [name for name in logged if "failure" in name], "the agent's tool failures are unknown"


def test_tool_metrics_of_a_white_box_session_count_failed_calls():
    ok, failed = ToolResult(data="ok"), ToolResult(error="no such file")
    trace = [ToolTraceEntry("read", {}, ok), ToolTraceEntry("read", {}, failed), ToolTraceEntry("ls", {}, ok)]
    trace.append(ToolTraceEntry("sudo", {}, ToolResult(error="no such tool")))  # the model's invention
    window = MetricsWindow()
    white_box_tool_calls(trace, declared={"read", "ls"}).record(window)
    logged = window.summarize()
    assert logged["tools/read/call_count"] == 2.0 and logged["tools/read/failure_count"] == 1.0
    assert logged["tools/ls/failure_count"] == 0.0
    assert logged["tools/undeclared/call_count"] == 1.0 and logged["tools/undeclared/failure_count"] == 1.0
    assert not [name for name in logged if "/sudo/" in name]
    assert logged["tools/failure_frequency"] == pytest.approx(2 / 4)  # 2 failed calls of 4


# -- the capture proxy, its sampling stubbed ---------------------------------------------------------------

# Bounds, not waits: only a failing test reaches them.
REQUEST_BOUND_S = 60.0


def stub_sampler(tokenizer):
    """generate_one_turn's stand-in: the reply "Hello." to any prompt, at log-prob -0.5 a token."""

    async def sample_turn(prompt_ids):
        output = tokenizer.encode("Hello.", add_special_tokens=False)
        return TurnRecord(list(prompt_ids), output, [-0.5] * len(output), finish_reason="stop")

    return sample_turn


def ask(text: str) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}]}


async def run_proxy(tokenizer, max_request_bytes, scenario):
    """`scenario(post)` against a started proxy; `post(body)` -> (status, JSON reply) for one session."""
    proxy = CaptureProxy(
        tokenizer, stub_sampler(tokenizer), "tiny", {"enable_thinking": False}, False, max_request_bytes
    )
    endpoint = await proxy.start()
    headers = {"Authorization": f"Bearer {proxy.open_session('ep')}"}
    timeout = aiohttp.ClientTimeout(total=REQUEST_BOUND_S)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as client:

            async def post(body):
                """`body`: a request (sent as JSON, with its length) or a stream of bytes (chunked)."""
                data = json.dumps(body) if isinstance(body, dict) else body
                url = f"{endpoint.base_url}/chat/completions"
                async with client.post(url, data=data, headers=headers) as reply:
                    return reply.status, await reply.json(content_type=None)

            return await scenario(post), proxy
    finally:
        await proxy.stop()


def test_a_body_over_the_proxys_cap_gets_a_413_that_says_why_and_the_session_goes_on(tokenizer):
    cap = 2**20

    async def chunks():  # no Content-Length: the cap holds while the body is read
        for _ in range(3):
            yield b"x" * cap

    async def scenario(post):
        declared = await post(ask("x" * (2 * cap)))
        chunked = await post(chunks())
        fine = await post(ask("What is 2 + 2?"))
        return declared, chunked, fine

    (declared, chunked, fine), proxy = asyncio.run(run_proxy(tokenizer, cap, scenario))
    for status, reply in (declared, chunked):
        assert status == 413, reply
        message = reply["error"]["message"]
        assert f"limit of {cap} bytes" in message and "harness_max_request_mb=1" in message
    assert "2097" in declared[1]["error"]["message"], "the declared size is named"
    status, reply = fine
    assert status == 200 and reply["choices"][0]["message"]["content"] == "Hello."
    assert [turn.node_id for turn in proxy.sessions[next(iter(proxy.sessions))].turns] == ["ep-0"]


def test_a_request_being_templated_holds_up_no_other_request(tokenizer, monkeypatch):
    """The chat template runs off the event loop: while one request's template is held (an event
    the test sets), another request is answered."""
    render, entered, release = capture.render_prompt_ids, threading.Event(), threading.Event()
    held_past_bound = []

    def held_render(tokenizer, messages, *args):
        if messages[-1]["content"] == "slow":
            entered.set()
            held_past_bound.append(not release.wait(REQUEST_BOUND_S))
        return render(tokenizer, messages, *args)

    monkeypatch.setattr(capture, "render_prompt_ids", held_render)

    async def scenario(post):
        slow = asyncio.ensure_future(post(ask("slow")))
        assert await asyncio.to_thread(entered.wait, REQUEST_BOUND_S)
        fast = await post(ask("fast"))
        answered_while_held = not slow.done()
        release.set()
        return fast, answered_while_held, await slow

    (fast, answered_while_held, slow), _ = asyncio.run(run_proxy(tokenizer, 2**20, scenario))
    assert held_past_bound == [False], "the held request's template was never let go by the test"
    assert answered_while_held and fast[0] == 200 and slow[0] == 200
