"""HarnessAsyncGRPOTrainer end to end against the real vLLM CPU server: a real agent program
(examples/harness/file_agent.py, the `openai` package) trained through ProcessSessionFactory and the
capture proxy, its faults counted, the trainer stopped with agents in flight, and one white-box run
through a HarnessAdapter (OpenEnv's interface, here without OpenEnv)."""

from __future__ import annotations

import copy
import functools
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip(
    "datasets", reason="datasets is not installed (a GPU host may lack the non-torch dependencies)"
)
pytest.importorskip("psutil", reason="psutil is not installed")
import psutil
from conftest import make_config
from datasets import Dataset
from test_trainer_e2e import restore_server
from transformers import TrainerCallback

from asyncgrpo import HarnessAsyncGRPOTrainer
from asyncgrpo.harness import (
    HarnessRolloutResult,
    ProcessSessionFactory,
    Tool,
    ToolResult,
    ToolTraceEntry,
    VerifyResult,
)

pytestmark = pytest.mark.vllm

AGENT = Path(__file__).resolve().parent.parent / "examples" / "harness" / "file_agent.py"
NO_THINKING = {"enable_thinking": False}
# The run's own policy at every trained token (max_staleness=0): trainer and sampler log-probs of
# the captured ids agree up to float32 kernels' differences.
EXACT_LOGPROB_GAP = 1e-3


# The fault run's timeout: what the "hang" agents cost, and the bound on every other agent of that run
# (an agent took about 5 s to start on a loaded 2-core machine, the `openai` import most of it).
HANG_TIMEOUT_S = 30


def written_length(workdir: Path, transcript) -> float:
    """The reward: the length of what the agent wrote into files, modulo 5: it varies between the
    rollouts of a random tiny model, so groups bring samples."""
    files = [path for path in workdir.iterdir() if path.name != "task.json"]
    return float(sum(len(path.read_text(errors="replace")) for path in files) % 5)


def rows(*modes: str) -> Dataset:
    return Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": f"Write a short note number {i}."}], "mode": mode}
            for i, mode in enumerate(modes)
        ]
    )


def agent_processes() -> list:
    """Agent processes of this checkout still alive."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if str(AGENT) in (process.info["cmdline"] or []):
            found.append(process)
    return found


@pytest.fixture(autouse=True)
def shared_server_weights_restored(request, tiny_model_dir):
    """Every run here syncs its weights into the shared server: put the originals back."""
    yield
    if "vllm_server" in request.fixturenames:
        restore_server(request.getfixturevalue("vllm_server").url, tiny_model_dir)


@pytest.fixture
def agent_tmp(tmp_path, monkeypatch):
    """Agents' working directories go under the test's own folder (the worker inherits TMPDIR)."""
    folder = tmp_path / "agents"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", None)
    return folder


def harness_config(server, output_dir, **overrides):
    return make_config(
        server,
        output_dir,
        token_budget=0,  # a step trains one group: 4 samples (the agent's 2 turns chain into 1 each)
        per_device_train_batch_size=4,
        train_sampling_strategy="sequential",
        chat_template_kwargs=NO_THINKING,
        **overrides,
    )


@pytest.mark.timeout(300)
def test_agent_program_trains_on_its_captured_tokens_and_faults_are_counted(
    vllm_server, tiny_model_dir, tmp_path, agent_tmp
):
    # One group at a time (num_generations=4): the three fault groups are scored before any sample
    # reaches the trainer, so the first step's window holds their counts.
    args = harness_config(
        vllm_server, tmp_path / "run", max_steps=1, max_staleness=0, max_concurrent_rollouts=4
    )
    factory = functools.partial(
        ProcessSessionFactory,
        command=[sys.executable, str(AGENT)],
        verify=written_length,
        timeout_s=HANG_TIMEOUT_S,
    )
    trainer = HarnessAsyncGRPOTrainer(
        model=str(tiny_model_dir),
        args=args,
        train_dataset=rows("crash", "hang", "silent", "ok", "ok"),
        harness_session_factory=factory,
    )
    trainer.train()
    history = trainer.state.log_history
    steps = [entry for entry in history if "loss" in entry]
    assert len(steps) == 1
    failed = sum(entry.get("rollout/harness_failed_count", 0) for entry in history)
    # The crash, hang and silent groups: 4 unscorable rollouts each (more when the run wrapped to
    # the next epoch and started them again before it stopped).
    assert failed >= 12
    gaps = [entry["sampling/sampling_logp_difference/max"] for entry in steps]
    assert max(gaps) < EXACT_LOGPROB_GAP, gaps
    assert any(math.isfinite(entry.get("rewards/harness_reward/mean", math.nan)) for entry in history)
    # The agent's draft and review turns (how they chain into samples: test_harness_units.py).
    assert [entry["rollout/turns_max"] for entry in steps] == [2.0]
    assert not agent_processes()
    assert not list(agent_tmp.iterdir()), "every session's directory is removed"


class WaitForAgentsInFlight(TrainerCallback):
    """Ends the step only once agent processes are running, so the trainer stops with sessions in
    flight (not by luck of timing)."""

    def __init__(self):
        self.seen = 0

    def on_step_end(self, args, state, control, **kwargs):
        deadline = time.monotonic() + AGENT_START_BOUND_S
        while not (running := agent_processes()) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.seen = len(running)


# How long the step waits for the "hang" sessions' agents to start (they start as soon as the first
# group is scored); the bound only turns a failure into an error rather than a hang.
AGENT_START_BOUND_S = 120


@pytest.mark.timeout(300)
def test_stopping_the_trainer_ends_the_agents_in_flight(vllm_server, tiny_model_dir, tmp_path, agent_tmp):
    # The first group is one at a time (no token estimate yet) and brings the step; the "hang" groups
    # after it never end by themselves (timeout_s far beyond the run): stopping must end them.
    args = harness_config(vllm_server, tmp_path / "run", max_steps=1, max_concurrent_rollouts=8)
    factory = functools.partial(
        ProcessSessionFactory, command=[sys.executable, str(AGENT)], verify=written_length, timeout_s=3600
    )
    waiter = WaitForAgentsInFlight()
    trainer = HarnessAsyncGRPOTrainer(
        model=str(tiny_model_dir),
        args=args,
        train_dataset=rows("ok", "hang", "hang", "hang"),
        harness_session_factory=factory,
        callbacks=[waiter],
    )
    trainer.train()
    assert waiter.seen > 0, "the trainer must stop with agents running"
    assert not agent_processes()
    assert not list(agent_tmp.iterdir())


# -- white-box: an adapter drives the session, the trainer samples each turn -------------------------


class NoteSession:
    def __init__(self, task):
        self.task = task
        self.notes: list[str] = []

    def initial_messages(self):
        return list(self.task)

    def list_tools(self):
        schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
        return [Tool(name="write_note", description="Keep a note.", input_schema=schema)]

    def call_tool(self, name, arguments):
        self.notes.append(str(arguments.get("text", "")))
        return ToolResult(data="ok")

    def verify(self, transcript, final_state=None):
        text = "".join(self.notes) + "".join(
            str(m.get("content") or "") for m in transcript if m["role"] == "assistant"
        )
        return VerifyResult(env_reward=min(len(text), 60) / 10, done=True)

    def close(self):
        self.notes = []


class NoteSessionFactory:
    def create(self, task, seed=None, episode_id=None):
        return NoteSession(task)


class NoteAdapter:
    """A user's white-box harness: model turn, its tool calls, until a turn calls none."""

    def run_white_box(self, model_step, session, limits=None):
        messages, trace = session.initial_messages(), []
        tools = session.list_tools()
        for _ in range(limits.max_turns):
            step = model_step(messages, tools, limits.sampling)
            messages.append(step.response.to_message_dict())
            if not step.response.tool_calls:
                break
            for call in step.response.tool_calls:
                result = session.call_tool(call.name, call.args)
                trace.append(ToolTraceEntry(call.name, call.args, result))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result.data)})
        return HarnessRolloutResult(messages=messages, tool_trace=trace)

    def run_black_box(self, session, limits=None):
        raise NotImplementedError("this harness is trained white-box only")


@pytest.mark.timeout(300)
def test_white_box_adapter_run_trains_the_turns_the_trainer_sampled(vllm_server, tiny_model_dir, tmp_path):
    args = harness_config(vllm_server, tmp_path / "run", max_steps=1, max_staleness=0)
    trainer = HarnessAsyncGRPOTrainer(
        model=str(tiny_model_dir),
        args=args,
        train_dataset=rows("ok", "ok", "ok"),
        harness_session_factory=NoteSessionFactory,
        harness_adapter=NoteAdapter(),
    )
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(steps) == 1
    assert steps[0]["sampling/sampling_logp_difference/max"] < EXACT_LOGPROB_GAP
    assert any("rewards/harness_reward/mean" in entry for entry in trainer.state.log_history)


# -- a session spanning a weight sync ------------------------------------------------------------------------

SPAN_AGENT = Path(__file__).resolve().parent / "harness_span_agent.py"


def noise_reward(workdir: Path, transcript) -> float:
    """A reward that differs between any two rollouts, so no group is dropped for equal rewards: this
    run is about which version sampled each turn, not about learning."""
    return random.random()


class SyncBetweenTurns(TrainerCallback):
    """Step 1 starts only once every "span" agent has made its first call (under version 0); once
    step 1 has synced version 1 to the server, the agents are let go for their second call. Keeps a
    copy of each version's weights, to tell afterwards which version sampled a token."""

    def __init__(self, signals: Path, agents: int):
        self.signals, self.agents = signals, agents
        self.versions: list[dict] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.versions.append(copy.deepcopy(model.state_dict()))

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            firsts = lambda: len(list(self.signals.glob("*.first")))  # noqa: E731
            deadline = time.monotonic() + AGENT_START_BOUND_S
            while firsts() < self.agents and time.monotonic() < deadline:
                time.sleep(0.05)
            assert firsts() == self.agents, "the span agents never made their first call"

    def on_step_end(self, args, state, control, model=None, **kwargs):
        # weight_sync_steps=1: the step's weights are on the server (version = steps taken) already.
        self.versions.append(copy.deepcopy(model.state_dict()))
        (self.signals / "go").write_text("")


class RecordingTrainer(HarnessAsyncGRPOTrainer):
    """Keeps every sample the trainer takes."""

    def _wait_for_samples(self, model):
        batch = super()._wait_for_samples(model)
        self.taken = getattr(self, "taken", []) + list(batch.samples)
        return batch


def trained_segments(sample) -> list[tuple[int, int]]:
    """The [start, end) of each run of trained tokens: one per turn of a chained sample."""
    trained = sample.trained.tolist() + [False]
    runs, start = [], None
    for index, flag in enumerate(trained):
        if flag and start is None:
            start = index
        elif not flag and start is not None:
            runs.append((start, index))
            start = None
    return runs


@pytest.mark.timeout(300)
def test_a_session_spanning_a_weight_sync_trains_each_turn_against_its_own_version(
    vllm_server, tiny_model_dir, tmp_path, agent_tmp
):
    import torch
    from test_harness_learning import PROMPTS, letter_warm_start

    # The tiny model from random weights rarely ends a turn (16 tokens, cut): a cut turn re-rendered
    # with its end-of-turn token forks a new sample, and the two turns would never share one. The
    # learning test's warm start (seconds) makes it answer one letter and end its turn.
    torch.set_num_threads(1)  # the server's CPU engine holds the other core
    warm_dir, _, _ = letter_warm_start(tmp_path / "warm")
    restore_server(vllm_server.url, warm_dir)
    signals = tmp_path / "signals"
    signals.mkdir()
    group = 4
    waiter = SyncBetweenTurns(signals, agents=group)
    # The "ok" group comes first, alone (no token estimate yet), and brings step 1; the "span" group's
    # first calls happen before step 1 starts, their second calls after its sync. max_staleness 2: the
    # span samples are never dropped, whichever of the next two steps takes them.
    args = harness_config(
        vllm_server,
        tmp_path / "run",
        max_steps=3,
        max_staleness=2,
        max_concurrent_rollouts=8,
        learning_rate=1e-3,
    )
    factory = functools.partial(
        ProcessSessionFactory,
        command=[sys.executable, str(SPAN_AGENT)],
        verify=noise_reward,
        env={"SPAN_SIGNALS": str(signals)},
    )
    trainer = RecordingTrainer(
        model=str(warm_dir),
        args=args,
        train_dataset=Dataset.from_list(
            [
                {"prompt": [{"role": "user", "content": PROMPTS[i]}], "mode": m}
                for i, m in enumerate(["ok", "span"])
            ]
        ),
        harness_session_factory=factory,
        callbacks=[waiter],
    )
    trainer.train()
    policy = copy.deepcopy(trainer.model).float().eval()

    def logprobs(state, sample) -> torch.Tensor:
        policy.load_state_dict(state)
        with torch.no_grad():
            ids = torch.tensor([sample.token_ids.tolist()])
            return torch.log_softmax(policy(input_ids=ids).logits[0, :-1].float(), -1)[
                torch.arange(ids.shape[1] - 1), ids[0, 1:]
            ]

    spanning = 0
    for sample in trainer.taken:
        per_version = [logprobs(state, sample) for state in waiter.versions]
        sampler = torch.as_tensor(sample.sampler_logprobs, dtype=torch.float32)
        offset, versions = 0, []
        for start, end in trained_segments(sample):
            recorded = sampler[offset : offset + end - start]
            offset += end - start
            gaps = [float((lp[start - 1 : end - 1] - recorded).abs().max()) for lp in per_version]
            best = min(range(len(gaps)), key=gaps.__getitem__)
            # Each turn's recorded log-probs are its own version's, exactly, and no other version's.
            assert gaps[best] < EXACT_LOGPROB_GAP, gaps
            assert sorted(gaps)[1] > EXACT_LOGPROB_GAP, gaps
            versions.append(best)
        assert sample.model_version == min(versions), "a sample counts as old as its oldest turn"
        spanning += versions == [0, 1]
    assert spanning, "no trained sample had its turns sampled under versions 0 and 1"
    staleness = [entry.get("sample/staleness_max", 0) for entry in trainer.state.log_history]
    assert max(staleness) >= 1


# -- the capture proxy's size cap ----------------------------------------------------------------------------

HUGE_AGENT = Path(__file__).resolve().parent / "harness_huge_agent.py"


@pytest.mark.timeout(300)
def test_a_50_mb_request_is_refused_with_a_413_while_the_other_agents_keep_generating(
    vllm_server, tiny_model_dir, tmp_path, agent_tmp
):
    # One group of 4 agents, started together: one sends a 50 MB body (over the default cap), then asks
    # as the other three do; the step trains the group's 4 samples, one per agent.
    claims = tmp_path / "claims"
    claims.mkdir()
    args = harness_config(vllm_server, tmp_path / "run", max_steps=1, max_concurrent_rollouts=4)
    factory = functools.partial(
        ProcessSessionFactory,
        command=[sys.executable, str(HUGE_AGENT)],
        verify=noise_reward,
        env={"HUGE_CLAIMS": str(claims)},
    )
    trainer = HarnessAsyncGRPOTrainer(
        model=str(tiny_model_dir), args=args, train_dataset=rows("ok", "ok"), harness_session_factory=factory
    )
    trainer.train()
    refused = json.loads((claims / "refused.json").read_text())
    assert refused["status"] == 413, refused
    assert (
        "over the capture proxy's limit" in refused["message"]
        and "harness_max_request_mb=16" in refused["message"]
    )
    history = trainer.state.log_history
    assert len([entry for entry in history if "loss" in entry]) == 1
    assert sum(entry.get("rollout/harness_failed_count", 0) for entry in history) == 0
    assert all(str(HUGE_AGENT) not in (p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))
    assert not list(agent_tmp.iterdir())


# -- evaluation through harness sessions ------------------------------------------------------------------

VERIFIED_HERE: list[str] = []  # sessions verified in this process: the trainer's, so evaluation's only


def counted_written_length(workdir: Path, transcript) -> float:
    VERIFIED_HERE.append(workdir.name)
    return written_length(workdir, transcript)


@pytest.mark.timeout(300)
def test_a_harness_run_evaluates_its_held_out_prompts_through_harness_sessions(
    vllm_server, tiny_model_dir, tmp_path, agent_tmp
):
    VERIFIED_HERE.clear()
    args = harness_config(
        vllm_server,
        tmp_path / "run",
        max_steps=1,
        max_concurrent_rollouts=4,
        eval_strategy="steps",
        eval_steps=1,
        num_generations_eval=2,
    )
    factory = functools.partial(
        ProcessSessionFactory, command=[sys.executable, str(AGENT)], verify=counted_written_length
    )
    trainer = HarnessAsyncGRPOTrainer(
        model=str(tiny_model_dir),
        args=args,
        train_dataset=rows("ok", "ok"),
        harness_session_factory=factory,
        eval_dataset=rows("ok", "ok", "ok"),
    )
    trainer.train()
    evals = [entry for entry in trainer.state.log_history if "eval_reward" in entry]
    assert len(evals) == 1 and math.isfinite(evals[0]["eval_reward"]), trainer.state.log_history
    # Training sessions are verified in the rollout worker; the 3 rows x 2 held-out sessions here.
    assert len(VERIFIED_HERE) == 3 * 2
    assert not agent_processes()
    assert not list(agent_tmp.iterdir())
