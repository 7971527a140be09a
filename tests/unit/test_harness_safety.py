"""What an agent process can and cannot do, without a server (docs/harness.md, "What an agent can and
cannot do"): it sees the prompt and the columns named for it while `verify` gets the trainer's row, it
starts with a minimal environment, it cannot hold a session by not reading stdin, its log is private
and capped, nothing it starts outlives it (double fork and `setsid` included), no signal goes to a
pid that may have been reused; and the harness's bounds: deadlines on calls into user code, the
bound on live sessions and its default."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import stat
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

from test_harness_units import FakeCapture, descendants, pid_alive, wait_until  # noqa: E402

from asyncgrpo.harness import ProcessSessionFactory, agent_environment, process_session  # noqa: E402
from asyncgrpo.harness.agent_sandbox import AgentSandbox  # noqa: E402
from asyncgrpo.harness.contract import ToolResult, VerifyResult  # noqa: E402
from asyncgrpo.harness.deadlines import DeadlineExceeded, ToolDeadlineSession, call_with_deadline  # noqa: E402
from asyncgrpo.harness.session_gate import SessionGate  # noqa: E402
from asyncgrpo.rollout.activity import ActivityBoard  # noqa: E402

# Bounds, not waits: only a failing test reaches them (a loaded machine starts a Python process in
# seconds, and a killed process is gone once the kernel has delivered the signal).
START_BOUND_S, KILL_DELIVERY_BOUND_S = 120.0, 10.0
PROMPT = [{"role": "user", "content": "What is 6 times 7?"}]


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    return tmp_path


def factory_for(program: str, verify=lambda workdir, transcript: 1.0, **options) -> ProcessSessionFactory:
    return ProcessSessionFactory([sys.executable, "-c", program], verify, capture=FakeCapture(), **options)


# -- the agent sees what the user chooses, the verifier sees the truth ---------------------------------------

CHEAT = """
import json, os, pathlib, sys
task = json.loads(pathlib.Path("task.json").read_text())
seen = {"keys": sorted(task), "stdin": json.loads(sys.stdin.read())}
pathlib.Path("seen.json").write_text(json.dumps(seen))
pathlib.Path("answer.txt").write_text("7")
# The answer key it hopes the verifier reads, in every file of its session it can reach.
forged = json.dumps({**task, "answer": "7"})
for folder, _, files in os.walk(pathlib.Path.cwd().parent):
    for name in files:
        if name not in ("answer.txt", "seen.json"):
            try:
                pathlib.Path(folder, name).write_text(forged)
            except OSError:  # out of its reach
                pass
"""


def answer_is_right(workdir: Path, transcript, row) -> float:
    """The example's kind of verify: the agent's answer.txt against the row's answer."""
    return float((workdir / "answer.txt").read_text().strip() == str(row["answer"]))


def test_an_agent_that_rewrites_its_task_gets_no_reward_for_a_wrong_answer(private_tmp):
    factory = factory_for(CHEAT, answer_is_right, agent_columns=["hint"])
    row = {"prompt": PROMPT, "hint": "a number", "answer": "42"}
    session = factory.create(row, seed=1, episode_id="e")
    try:
        assert session.wait_for_completion() == 0
        assert json.loads((session.workdir / "task.json").read_text())["answer"] == "7"  # forged
        seen = json.loads((session.workdir / "seen.json").read_text())
        assert seen["keys"] == ["episode_id", "hint", "prompt", "sampling", "seed"], "no answer given"
        assert "answer" not in seen["stdin"]
        assert session.verify([]).env_reward == 0.0  # the trainer's row, not the forged file
        assert session.row == row
    finally:
        session.close()
        factory.close()
    assert row == {"prompt": PROMPT, "hint": "a number", "answer": "42"}, "the dataset's row is untouched"
    # A verify of two parameters (the old form) still works; a right answer is rewarded.
    honest = factory_for(
        "import pathlib; pathlib.Path('answer.txt').write_text('42')",
        lambda workdir, transcript: float((workdir / "answer.txt").read_text() == "42"),
    )
    session = honest.create(row)
    try:
        assert session.wait_for_completion() == 0 and session.verify([]).env_reward == 1.0
    finally:
        session.close()
        honest.close()


def test_agent_columns_are_checked():
    with pytest.raises(ValueError, match="task.json sets"):
        factory_for("pass", agent_columns=["seed"])
    with pytest.raises(ValueError, match="list of column names"):
        factory_for("pass", agent_columns="hint")
    with pytest.raises(ValueError, match="the dataset row lacks"):
        factory_for("pass", agent_columns=["hint"]).create({"prompt": PROMPT})


# -- a clean environment -------------------------------------------------------------------------------------

SECRETS = {
    "HF_TOKEN": "hf_planted",
    "WANDB_API_KEY": "wandb-planted",
    "AWS_ACCESS_KEY_ID": "AKIAPLANTED",
    "AWS_SECRET_ACCESS_KEY": "aws-planted",
    "VLLM_API_KEY": "vllm-planted",
    "OPENAI_API_KEY": "sk-trainers-own-planted",
    "MASTER_ADDR": "10.9.8.7",
    "MASTER_PORT": "29555",
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "3",
    "PYTHONPATH": "/planted/path",
}
DUMP_ENVIRONMENT = (
    "import json, os, pathlib; pathlib.Path('env.json').write_text(json.dumps(dict(os.environ)))"
)


@pytest.mark.parametrize("sandbox", ["bubblewrap", "none"])
def test_an_agent_starts_with_a_minimal_environment(private_tmp, monkeypatch, sandbox):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    factory = factory_for(DUMP_ENVIRONMENT, env={"AGENT_SETTING": "given"}, agent_sandbox=sandbox)
    session = factory.create({"prompt": PROMPT}, episode_id="e")
    try:
        assert session.wait_for_completion() == 0
        env = json.loads((session.workdir / "env.json").read_text())
    finally:
        session.close()
        factory.close()
    assert not set(SECRETS.values()) & set(env.values()), "a trainer secret reached the agent"
    assert env["OPENAI_API_KEY"] == "key-e" and env["AGENT_SETTING"] == "given" and env["LC_ALL"] == "C.UTF-8"
    assert env["PATH"] == os.environ["PATH"]
    if sandbox == "none":
        assert env["OPENAI_BASE_URL"] == FakeCapture.base_url and env["HOME"] == os.environ["HOME"]
        assert Path(env["TMPDIR"]) == session.root / "tmp"
    else:  # its own home and temporary folder, and the proxy through the sandbox's bridge
        assert env["OPENAI_BASE_URL"] == AgentSandbox.base_url
        assert (env["HOME"], env["TMPDIR"]) == (AgentSandbox.home, AgentSandbox.temp_dir)
        assert env.pop("PWD") == AgentSandbox.workdir  # set by bubblewrap with the working directory
    allowed = {"PATH", "HOME", "LANG", "LANGUAGE", "TMPDIR", "TMP", "TEMP", "AGENT_SETTING"}
    allowed |= {"OPENAI_BASE_URL", "OPENAI_API_KEY", "OPENAI_MODEL"}
    assert {name for name in env if not name.startswith("LC_")} <= allowed


# -- every wait bounded --------------------------------------------------------------------------------------

NEVER_READS_STDIN = "import threading; threading.Event().wait()"
BIG_COLUMN = "x" * 200_000  # more than a pipe holds: a blocking write would wait for the agent to read it


@pytest.mark.timeout(120)
def test_an_agent_that_never_reads_stdin_holds_nothing_and_its_timeout_counts_from_its_start(private_tmp):
    timeout_s = 5.0
    factory = factory_for(NEVER_READS_STDIN, timeout_s=timeout_s, agent_columns=["notes"])
    started = time.monotonic()
    session = factory.create({"prompt": PROMPT, "notes": BIG_COLUMN})
    created_s = time.monotonic() - started
    try:
        assert created_s < timeout_s, f"create() waited {created_s:.1f} s on the agent"
        time.sleep(max(0.0, started + timeout_s - time.monotonic()) + 0.2)  # past the agent's timeout
        waited = time.monotonic()
        with pytest.raises(TimeoutError, match="timeout_s=5"):
            session.wait_for_completion()
        # Counted from the agent's start: the timeout had passed, so no new timeout_s of waiting.
        assert time.monotonic() - waited < timeout_s
        assert len(json.loads((session.workdir / "task.json").read_text())["notes"]) == len(BIG_COLUMN)
    finally:
        session.close()
        factory.close()


def test_a_call_past_its_deadline_is_abandoned_and_the_calls_own_errors_pass_through():
    assert call_with_deadline(lambda: 3, 5.0, "f()", "reward_timeout") == 3

    def own_timeout():
        raise TimeoutError("the call's own")

    with pytest.raises(TimeoutError, match="the call's own"):  # not mistaken for the deadline
        call_with_deadline(own_timeout, 5.0, "f()", "reward_timeout")
    release = threading.Event()
    with pytest.raises(DeadlineExceeded, match=r"verify\(\) did not return within reward_timeout=0.2 s"):
        call_with_deadline(release.wait, 0.2, "verify()", "reward_timeout")
    release.set()


def test_a_result_that_comes_after_the_deadline_is_handed_over_to_be_released():
    """A create() that returns late has started an agent: its session goes to the owner to close."""
    release, handed = threading.Event(), queue.Queue()

    def slow_create():
        release.wait()
        return "the late session"

    with pytest.raises(DeadlineExceeded):
        call_with_deadline(slow_create, 0.2, "create()", "harness_timeout_s", on_late_result=handed.put)
    release.set()
    assert handed.get(timeout=30) == "the late session"
    # In time, the result is the caller's and nothing is handed over.
    assert call_with_deadline(lambda: 5, 5.0, "create()", "harness_timeout_s", on_late_result=handed.put) == 5
    assert handed.empty()


class HangingToolSession:
    def __init__(self):
        self.release = threading.Event()

    def initial_messages(self):
        return []

    def list_tools(self):
        return []

    def call_tool(self, name, arguments):
        if name == "hang":
            self.release.wait()
        return ToolResult(data="ok")

    def verify(self, transcript, final_state=None):
        return VerifyResult(env_reward=1.0)

    def close(self):
        self.release.set()


def test_a_white_box_tool_past_tool_timeout_is_an_error_and_is_counted():
    board = ActivityBoard()
    session = ToolDeadlineSession(HangingToolSession(), 0.2, board)
    assert session.call_tool("fine", {}).data == "ok"
    result = session.call_tool("hang", {})
    assert result.error == "the tool did not return within tool_timeout=0.2 s"
    assert session.timeouts == 1 and board.describe() == ""
    session.close()


def test_the_stuck_generation_error_names_what_the_rollouts_wait_on():
    board = ActivityBoard()
    with board.waiting_on("verify()"), board.waiting_on("verify()"), board.waiting_on("tool 'search'"):
        assert board.describe(now=time.monotonic() + 100) == (
            "2 waiting on verify() for up to 100 s, 1 on tool 'search' for 100 s"
        )
    assert board.describe() == ""


# -- sessions the machine can run ----------------------------------------------------------------------------


def test_the_session_gate_holds_sessions_back_at_its_limit_and_says_so(caplog):
    async def scenario():
        gate = SessionGate(2)
        alive, most, waits = 0, 0, []
        go = asyncio.Event()

        async def session():
            nonlocal alive, most
            waits.append(await gate.acquire())
            alive += 1
            most = max(most, alive)
            await go.wait()
            alive -= 1
            gate.release()

        tasks = [asyncio.create_task(session()) for _ in range(5)]
        while gate.waiting < 3:
            await asyncio.sleep(0)
        go.set()
        await asyncio.gather(*tasks)
        return most, waits

    with caplog.at_level(logging.WARNING, logger="asyncgrpo.harness.session_gate"):
        most, waits = asyncio.run(scenario())
    assert most == 2 and len(waits) == 5
    (record,) = caplog.records  # once: the log repeats at most every minute
    assert "holding generation back: 2 harness sessions are alive" in record.getMessage()
    assert "raise max_agents" in record.getMessage()


def test_the_default_bound_on_agents_comes_from_the_machine(monkeypatch):
    monkeypatch.setattr(agent_environment, "usable_cores", lambda: 2)
    monkeypatch.setattr(agent_environment, "available_memory_bytes", lambda: 100 * 2**30)
    assert agent_environment.default_max_agents() == 2 * agent_environment.AGENTS_PER_CORE
    monkeypatch.setattr(agent_environment, "available_memory_bytes", lambda: 3 * 256 * 2**20)
    assert agent_environment.default_max_agents() == 3  # the memory holds fewer
    monkeypatch.setattr(agent_environment, "available_memory_bytes", lambda: 0)
    assert agent_environment.default_max_agents() == 1
    assert factory_for("pass", max_agents=5).max_live_sessions == 5
    with pytest.raises(ValueError, match="max_agents=0"):
        factory_for("pass", max_agents=0)


# -- clean-up that always finishes ---------------------------------------------------------------------------

ESCAPE = """
import os, pathlib, sys, threading
if os.fork() == 0:
    os.setsid()  # out of the agent's process group and session
    if os.fork() == 0:
        pathlib.Path("escapee.pid").write_text(str(os.getpid()))
        threading.Event().wait()
    os._exit(0)
os.wait()
if sys.argv[1] == "stay":
    threading.Event().wait()
# "exit": the agent exits once the test has seen its escapee alive (else the supervisor may end the
# escapee before the test looks at it)
while not pathlib.Path("seen").exists():
    threading.Event().wait(0.05)
"""


@pytest.mark.parametrize("sandbox", ["bubblewrap", "none"])
@pytest.mark.parametrize("how", ["the agent exits", "the session closes"])
def test_a_process_that_double_forks_out_of_the_agents_session_is_ended(private_tmp, how, sandbox):
    mode = "exit" if how == "the agent exits" else "stay"
    factory = ProcessSessionFactory(
        [sys.executable, "-c", ESCAPE, mode],
        lambda w, t: 1.0,
        timeout_s=600,
        capture=FakeCapture(),
        agent_sandbox=sandbox,
    )
    session = factory.create({"prompt": PROMPT})
    try:
        pid_file = session.workdir / "escapee.pid"
        assert wait_until(lambda: pid_file.exists() and pid_file.read_text(), START_BOUND_S)
        # From outside: the agent's pids are its namespace's own when sandboxed.
        processes = descendants(session.process.pid)
        sessions = {os.getsid(pid) for pid in processes if pid_alive(pid)}
        assert len(sessions) >= 2, "the escapee left the agent's session"
        if mode == "exit":
            (session.workdir / "seen").write_text("")
            assert session.wait_for_completion() == 0
        else:
            session.close()
        assert wait_until(lambda: not any(map(pid_alive, processes)), KILL_DELIVERY_BOUND_S), (
            f"it outlived {how}"
        )
    finally:
        session.close()
        factory.close()


CHATTY = """
import sys
for _ in range(48):
    sys.stdout.write("x" * 65535 + "\\n")
sys.stdout.write("THE END")
"""


def test_the_agents_log_is_private_and_capped(private_tmp):
    factory = factory_for(CHATTY)
    session = factory.create({"prompt": PROMPT})
    try:
        assert session.wait_for_completion() == 0
        log = session.output_path
        assert log.parent == session.root and session.workdir != log.parent  # verify never sees it
        assert stat.S_IMODE(log.stat().st_mode) == 0o600
        assert stat.S_IMODE(session.root.stat().st_mode) == 0o700
        assert log.stat().st_size <= process_session.OUTPUT_CAP_BYTES  # 3 MiB written
        assert session.output_tail().endswith("THE END")
    finally:
        session.close()
        factory.close()
    assert not list(private_tmp.iterdir())


def test_closing_a_session_whose_agent_has_exited_signals_no_pid(private_tmp, monkeypatch):
    factory = factory_for("pass")
    session = factory.create({"prompt": PROMPT})
    assert session.wait_for_completion() == 0  # exited, and reaped: its pid may now be anyone's
    sent = []
    monkeypatch.setattr(os, "kill", lambda *args: sent.append(("kill", args)))
    monkeypatch.setattr(os, "killpg", lambda *args: sent.append(("killpg", args)))
    session.close()
    factory.close()
    assert sent == []
