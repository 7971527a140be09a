"""HarnessAsyncGRPOTrainer end to end against the real vLLM CPU server: a real agent program
(examples/harness/file_agent.py, the `openai` package) trained through ProcessSessionFactory and the
capture proxy, its faults counted, the trainer stopped with agents in flight, and one white-box run
through a HarnessAdapter (OpenEnv's interface, here without OpenEnv)."""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from support_paths import SUPPORT

pytest.importorskip(
    "datasets", reason="datasets is not installed (a GPU host may lack the non-torch dependencies)"
)
pytest.importorskip("psutil", reason="psutil is not installed")
import psutil
import worker_side  # what the rollout worker imports: tests/support/worker_side.py says why
from conftest import make_config
from datasets import Dataset, load_dataset
from test_trainer_e2e import restore_server
from transformers import TrainerCallback
from worker_side import (
    ModeNoteSessionFactory,
    NoteAdapter,
    NoteFirstAdapter,
    NoteSessionFactory,
    counted_written_length,
    hostile_code_reward,
    judged_like_the_example,
    no_session_reward,
    noise_verdict,
    saturating_prompts,
    saturating_reward,
    written_length,
)

from asyncgrpo import HarnessAsyncGRPOTrainer
from asyncgrpo.harness import (
    ProcessSessionFactory,
)
from asyncgrpo.sandbox import SandboxLimits
from asyncgrpo.sandbox.bubblewrap import PROXY_PORT

pytestmark = pytest.mark.vllm

AGENT = Path(__file__).resolve().parents[2] / "examples" / "harness" / "file_agent.py"
NO_THINKING = {"enable_thinking": False}
# The run's own policy at every trained token (max_staleness=0): trainer and sampler log-probs of
# the captured ids agree up to float32 kernels' differences.
EXACT_LOGPROB_GAP = 1e-3


# The fault run's timeout: what the "hang" agents cost, and the bound on every other agent of that run
# (an agent took about 5 s to start on a loaded 2-core machine, the `openai` import most of it).
HANG_TIMEOUT_S = 30


def rows(*modes: str) -> Dataset:
    return Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": f"Write a short note number {i}."}], "mode": mode}
            for i, mode in enumerate(modes)
        ]
    )


def agent_processes(agent_tmp: Path) -> list:
    """This test's agent processes still alive: those of the example agent run by a session whose folder
    lies under the test's agent folder (another test module may run the same agent meanwhile, in a
    parallel worker). A sandboxed agent's working directory is its own namespace's: its session's
    supervisor, outside, is found among its ancestors, in the session's folder."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if str(AGENT) not in (process.info["cmdline"] or []):
            continue
        try:
            if any(each.cwd().startswith(str(agent_tmp)) for each in [process, *process.parents()]):
                found.append(process)
        except psutil.Error:  # it ended meanwhile
            continue
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
    options = dict(
        token_budget=0,  # a step trains one group: 4 samples (the agent's 2 turns chain into 1 each)
        per_device_train_batch_size=4,
        train_sampling_strategy="sequential",
        chat_template_kwargs=NO_THINKING,
    )
    return make_config(server, output_dir, **{**options, **overrides})


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
        agent_columns=["mode"],
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
    assert not agent_processes(agent_tmp)
    assert not list(agent_tmp.iterdir()), "every session's directory is removed"


class WaitForAgentsInFlight(TrainerCallback):
    """Ends the step only once agent processes are running, so the trainer stops with sessions in
    flight (not by luck of timing)."""

    def __init__(self, agent_tmp: Path):
        self.agent_tmp = agent_tmp
        self.seen = 0

    def on_step_end(self, args, state, control, **kwargs):
        deadline = time.monotonic() + AGENT_START_BOUND_S
        while not (running := agent_processes(self.agent_tmp)) and time.monotonic() < deadline:
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
        ProcessSessionFactory,
        command=[sys.executable, str(AGENT)],
        verify=written_length,
        timeout_s=3600,
        agent_columns=["mode"],
    )
    waiter = WaitForAgentsInFlight(agent_tmp)
    trainer = HarnessAsyncGRPOTrainer(
        model=str(tiny_model_dir),
        args=args,
        train_dataset=rows("ok", "hang", "hang", "hang"),
        harness_session_factory=factory,
        callbacks=[waiter],
    )
    trainer.train()
    assert waiter.seen > 0, "the trainer must stop with agents running"
    assert not agent_processes(agent_tmp)
    assert not list(agent_tmp.iterdir())


# -- agents that cannot cheat, steal or hang the run ------------------------------------------------------

ADVERSARY = SUPPORT / "harness_adversary_agent.py"
ADVERSARY_TOOLS = ("sandbox_spy_agent.py", "sandbox_hog_agent.py")  # what its "spy" and "hog" modes run
ESCAPEE_MARK = "asyncgrpo-test-escapee"  # on the command line of the process it double-forks
# The trainer's secrets, planted in its environment (which the rollout worker inherits): no agent may see
# any of them. (torchrun's RANK and WORLD_SIZE would make this run distributed; the unit test plants them.)
PLANTED = {
    "HF_TOKEN": "hf_planted_e2e",
    "WANDB_API_KEY": "wandb-planted-e2e",
    "AWS_SECRET_ACCESS_KEY": "aws-planted-e2e",
    "VLLM_API_KEY": "vllm-planted-e2e",  # the shared server wants no key: sending it is harmless
    "OPENAI_API_KEY": "sk-planted-e2e",
    "MASTER_ADDR": "10.9.8.7",
    "MASTER_PORT": "29555",
}
# More than a pipe holds: written to the stdin of an agent that never reads it, a blocking write waited
# for the agent's exit.
PADDING = "x" * 200_000
# An agent's timeout, and how long past it a sleeping agent may live (its end is watched every 0.1 s).
# The timeout counts from the agent's own start, after its wait for a place: the others take a second
# or a few (one model call) on an idle machine, the hog about 12 s in a loaded CI run, so the sleeper's
# timeout is all it adds to the run. (The spy once scanned all 65,535 ports, up to 25 s loaded: it now
# reads its network's listening sockets, tests/support/sandbox_spy_agent.py.)
ADVERSARY_TIMEOUT_S, END_SLACK_S = 25, 15
# One agent alive at once, groups of two, a group's rollouts started when a place among
# max_concurrent_rollouts (two) frees: the agents run one after another in dataset order, so the groups
# end in that order whatever the machine's load. The "escape" group, the only one whose rewards differ,
# ends last of the first pass: the step trains it, after the sleeper's group (and its timeout count).
# (Two agents at once let a slow "escape" agent be overtaken by the next pass's groups, which bring
# nothing: a whole pass without a sample is an error.)
MAX_AGENTS, GROUP = 1, 2


def adversary_processes() -> list:
    """The adversary agents alive: the processes running the agent's own command line, and its children
    (which share it). The processes that only name the agent in theirs are left out: its supervisor,
    and the sandbox's bubblewrap processes, whose namespace init, once its session has closed, may
    still be on its way out, reparented away from any supervisor, while the next agent starts."""
    return [
        process
        for process in psutil.process_iter(["cmdline"])
        if process.info["cmdline"] == [sys.executable, str(ADVERSARY)]
    ]


def processes_naming_the_agent() -> list:
    """Every process whose command line names the adversary agent but its supervisors': once the run
    has ended, the agents, their children and their sandboxes' processes must all be gone."""
    return [
        process
        for process in psutil.process_iter(["cmdline"])
        if str(ADVERSARY) in (process.info["cmdline"] or [])
        and not any("supervisor.py" in part for part in process.info["cmdline"])
    ]


def agents_by_sandbox() -> dict[str, list[int]]:
    """The adversary agents' processes alive, by the PID namespace they run in: each sandbox has its own,
    and no process leaves it, so each namespace is one session's agent (its children, the escapee's
    double fork among them, included). Not by parent chain: while a sandbox ends, or an agent's child
    forks and exits, a parent reaped between reading a process's parent pid and looking that pid up
    ends psutil's parents() there, and the process counted as a session of its own: the likely cause
    of the two sessions a loaded CI run counted with one agent alive."""
    sandboxes: dict[str, list[int]] = {}
    for process in adversary_processes():
        try:
            namespace = os.readlink(f"/proc/{process.pid}/ns/pid")
        except OSError:  # it ended meanwhile
            continue
        sandboxes.setdefault(namespace, []).append(process.pid)
    return sandboxes


def host_pid(namespace_pid: int) -> int | None:
    """The pid, seen from here, of the adversary agent whose own namespace calls it `namespace_pid` (one
    agent is alive at a time: MAX_AGENTS)."""
    for process in adversary_processes():
        try:
            status = Path(f"/proc/{process.pid}/status").read_text()
        except OSError:
            continue
        nspids = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
        if nspids[-1:] == [str(namespace_pid)]:
            return process.pid
    return None


class AgentWatch(threading.Thread):
    """Counts the adversary agents alive, and times the sleeper's end, every 0.1 s until stopped."""

    def __init__(self, report: Path):
        super().__init__(daemon=True)
        self.report, self.most_alive, self.sleeper_ended_at = report, 0, None
        self.crowd: dict[str, list[int]] = {}  # the agents' processes when the most were alive
        self.done = threading.Event()

    def run(self):
        sleeper = None
        while not self.done.wait(0.1):
            sandboxes = agents_by_sandbox()
            if len(sandboxes) > self.most_alive:
                self.most_alive, self.crowd = len(sandboxes), sandboxes
            claim = self.report / "sleeper.json"
            if sleeper is None and claim.exists() and claim.read_text():
                sleeper = host_pid(json.loads(claim.read_text())["pid"])
            if sleeper is not None and self.sleeper_ended_at is None and not psutil.pid_exists(sleeper):
                self.sleeper_ended_at = time.time()
            elif sleeper is not None and self.sleeper_ended_at is None:
                try:
                    if psutil.Process(sleeper).status() == psutil.STATUS_ZOMBIE:
                        self.sleeper_ended_at = time.time()
                except psutil.NoSuchProcess:
                    self.sleeper_ended_at = time.time()


# The adversaries' sandbox: small, so that the hog's fork, allocation and disk floods end in a second.
ADVERSARY_LIMITS = SandboxLimits(
    memory_bytes=512 * 2**20, processes=32, cpu_seconds=120, file_bytes=16 * 2**20, disk_bytes=64 * 2**20
)
SPY_ANSWER = "1729"  # the spy's row's answer: in the training data on disk, nowhere in its task


def plant_the_trainers_machine(tmp_path: Path, monkeypatch, modes: list[str]) -> Dataset:
    """The machine as a new user's run leaves it: secrets in the trainer's environment (the rollout worker
    inherits them), a Hub token under its HOME, and the training data, answers included, in a JSONL file
    in its working folder, loaded from there."""
    for name, value in PLANTED.items():
        monkeypatch.setenv(name, value)
    home = tmp_path / "home"
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "token").write_text(PLANTED["HF_TOKEN"])
    monkeypatch.setenv("HOME", str(home))
    data = tmp_path / "data"
    data.mkdir()
    monkeypatch.chdir(data)
    question = [{"role": "user", "content": "What is 6 times 7? Write the number to answer.txt."}]
    rows = []
    for index, mode in enumerate(modes):
        prompt = [{**question[0], "content": f"{question[0]['content']} (row {index})"}]
        answer = SPY_ANSWER if mode == "spy" else "42"
        hint = {"cheat": "7", "spy": "none"}.get(mode, "42")
        rows.append({"prompt": prompt, "answer": answer, "hint": hint, "mode": mode, "padding": PADDING})
    with (data / "train.jsonl").open("w") as file:
        file.writelines(json.dumps(row) + "\n" for row in rows)
    return load_dataset("json", data_files=str(data / "train.jsonl"), split="train")


@pytest.mark.timeout(600)
def test_agents_cannot_cheat_steal_or_hang_the_run(
    vllm_server, tiny_model_dir, tmp_path, agent_tmp, monkeypatch
):
    report, records = tmp_path / "report", tmp_path / "records"
    report.mkdir()
    records.mkdir()
    # Groups of 2 in dataset order, one agent alive at once (see MAX_AGENTS). The "escape" group's random
    # rewards bring the step's 2 samples.
    args = harness_config(
        vllm_server,
        tmp_path / "run",
        max_steps=1,
        max_concurrent_rollouts=GROUP,
        num_generations=GROUP,
        per_device_train_batch_size=GROUP,
    )
    modes = ["honest", "cheat", "spy", "hog", "sleepy", "escape"]
    dataset = plant_the_trainers_machine(tmp_path, monkeypatch, modes)
    factory = functools.partial(
        ProcessSessionFactory,
        command=[sys.executable, str(ADVERSARY)],
        verify=functools.partial(judged_like_the_example, str(records)),
        timeout_s=ADVERSARY_TIMEOUT_S,
        env={"REPORT_DIR": str(report), "PLANTED_SECRETS": json.dumps(list(PLANTED.values()))},
        agent_columns=["hint", "mode", "padding"],
        max_agents=MAX_AGENTS,
        agent_limits=ADVERSARY_LIMITS,
        agent_readable_paths=[str(ADVERSARY.with_name(name)) for name in ADVERSARY_TOOLS],
        agent_writable_paths=[str(report)],
    )
    watch = AgentWatch(report)
    trainer = HarnessAsyncGRPOTrainer(
        model=str(tiny_model_dir),
        args=args,
        train_dataset=dataset,
        harness_session_factory=factory,
        reward_funcs=[hostile_code_reward],  # model-written code that forks and floods the disk
    )
    watch.start()
    try:
        trainer.train()
    finally:
        watch.done.set()
        watch.join()
    history = trainer.state.log_history
    assert len([entry for entry in history if "loss" in entry]) == 1, "the run went on to its step"
    # Cheat: the forged answer key and a wrong answer earn nothing; the honest answer earns 1.
    verdicts = [json.loads(path.read_text()) for path in records.iterdir()]
    by_mode = {mode: [v["reward"] for v in verdicts if v["mode"] == mode] for mode in modes}
    # (The worker goes on generating while the trainer steps: a row may be judged again.)
    assert len(by_mode["cheat"]) >= GROUP and set(by_mode["cheat"]) == {0.0}, by_mode
    assert len(by_mode["honest"]) >= GROUP and set(by_mode["honest"]) == {1.0}, by_mode
    assert len(by_mode["sleepy"]) >= GROUP - 1 and set(by_mode["sleepy"]) == {1.0}, by_mode
    # Steal: no agent saw a trainer secret in its environment; each had its session's key and the user's env.
    dumps = [json.loads(path.read_text()) for path in report.glob("*.env.json")]
    assert len(dumps) >= GROUP * len(modes)
    for env in dumps:
        assert not set(PLANTED.values()) & set(env.values()), sorted(env)
        assert env["OPENAI_API_KEY"].startswith("asyncgrpo-") and env["REPORT_DIR"] == str(report)
    # Spy: nothing of the machine found (secrets, token, data, ports, processes), so no stolen answer.
    spied = [json.loads(path.read_text()) for path in report.glob("*.spy.json")]
    assert len(spied) >= GROUP and len(by_mode["spy"]) >= GROUP and set(by_mode["spy"]) == {0.0}, by_mode
    for found in spied:
        assert not (found["secrets"] or found["tokens"] or found["data"]), found
        assert found["ports"] == [PROXY_PORT], found  # its own bridge to the capture proxy, nothing else
        assert found["processes"] <= 3, found  # bubblewrap's init, the sandbox's first process, itself
    # Hog: held to its limits, then ended past its disk bound (a failed rollout), and the run went on.
    hogs = [json.loads(path.read_text()) for path in report.glob("*.hog.json")]
    assert len(hogs) >= GROUP
    for taken in hogs:
        assert taken["fork"]["error"] and taken["fork"]["children"] <= ADVERSARY_LIMITS.processes - 3, taken
        assert taken["memory"]["error"] == "MemoryError" and taken["file"]["error"] == "File too large"
    # Never scored (verify runs only for an agent that exited 0), and counted as failed rollouts (the count
    # also holds the sleeper's; when exactly each window reaches the trainer is the worker's to say).
    assert by_mode["hog"] == [], by_mode
    assert sum(entry.get("rollout/harness_failed_count", 0) for entry in history) >= 1, history
    # The hostile code the reward function ran: 0.0 each time, no exception.
    code_rewards = [
        entry["rewards/hostile_code_reward/mean"]
        for entry in history
        if "rewards/hostile_code_reward/mean" in entry
    ]
    assert code_rewards and set(code_rewards) == {0.0}, history
    # Hang: the sleeper (a 200 KB row, stdin never read) ended at its timeout, counted, and the run went on.
    started = json.loads((report / "sleeper.json").read_text())["started"]
    assert watch.sleeper_ended_at is not None
    assert watch.sleeper_ended_at - started < ADVERSARY_TIMEOUT_S + END_SLACK_S
    assert sum(entry.get("rollout/harness_timeout_count", 0) for entry in history) >= 1, history
    # The machine's bound: never more than max_agents agents alive, and rollouts waited for a place.
    assert watch.most_alive <= MAX_AGENTS, watch.crowd
    assert any(entry.get("rollout/harness_session_wait_s", 0) > 0 for entry in history)
    # Escape: every process that double-forked out of its agent's session is gone.
    assert len(list(report.glob("escapee-*.pid"))) >= GROUP
    assert not escapees() and not processes_naming_the_agent() and not list(agent_tmp.iterdir())


def escapees() -> list:
    return [p for p in psutil.process_iter(["cmdline"]) if ESCAPEE_MARK in (p.info["cmdline"] or [])]


# -- white-box: an adapter drives the session, the trainer samples each turn -------------------------


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


@pytest.mark.timeout(300)
def test_a_harness_run_that_saturates_ends_as_at_max_steps(vllm_server, tiny_model_dir, tmp_path, caplog):
    """The harness trainer follows the policy on a pass without signal (docs/reliability.md): trained,
    then a whole pass of groups at one reward each (even rows always right, odd rows always wrong), it
    ends before max_steps with the saturation warning."""
    trainer = HarnessAsyncGRPOTrainer(
        model=str(tiny_model_dir),
        args=harness_config(vllm_server, tmp_path / "run", max_steps=50, max_completion_length=4),
        train_dataset=saturating_prompts(8, varying=4),
        harness_session_factory=NoteSessionFactory,
        harness_adapter=NoteAdapter(),
        rollout_reward_fn=no_session_reward,
        reward_funcs=saturating_reward,
    )
    trainer.train()
    assert 1 <= trainer.state.global_step < 50
    assert "brought nothing to train" in caplog.text and "Training ends here, as at max_steps" in caplog.text


# The run's deadlines, short: each hanging group ends at its deadline, not at the test's timeout. The
# harness's holds a "hang-tool" rollout (a sampled turn, then its tool cut at TOOL_DEADLINE_S) with room
# for a loaded machine: at 6 s, with the suite and a busy process beside it, those rollouts were cut too
# and no group was left to train.
REWARD_DEADLINE_S, TOOL_DEADLINE_S, HARNESS_DEADLINE_S = 3, 3, 20


@pytest.mark.timeout(300)
def test_a_hanging_verify_tool_and_adapter_are_cut_at_their_deadlines_and_counted(
    vllm_server, tiny_model_dir, tmp_path
):
    # A group's rollouts all end at the same deadline, so the groups are scored in dataset order: the
    # "hang-tool" group (its tool cut, its rollouts scored) brings the step after the other two.
    args = harness_config(
        vllm_server,
        tmp_path / "run",
        max_steps=1,
        max_concurrent_rollouts=4,
        reward_timeout=REWARD_DEADLINE_S,
        tool_timeout=TOOL_DEADLINE_S,
    )
    prompt = [{"role": "user", "content": "Write a note."}]
    trainer = HarnessAsyncGRPOTrainer(
        model=str(tiny_model_dir),
        args=args,
        train_dataset=Dataset.from_list(
            [{"prompt": prompt, "mode": mode} for mode in ("hang-adapter", "hang-verify", "hang-tool")]
        ),
        harness_session_factory=ModeNoteSessionFactory,
        harness_adapter=NoteFirstAdapter(),
        harness_timeout_s=HARNESS_DEADLINE_S,
    )
    trainer.train()
    history = trainer.state.log_history
    assert len([entry for entry in history if "loss" in entry]) == 1, "the run went on to its step"
    # The hanging adapters and verifies: each rollout unscored and counted; the tools: an error the
    # model sees, counted, the rollout scored.
    assert sum(entry.get("rollout/harness_timeout_count", 0) for entry in history) >= 4 + 4, history
    assert sum(entry.get("rollout/harness_failed_count", 0) for entry in history) >= 4 + 4
    assert sum(entry.get("tools/timeout_count", 0) for entry in history) >= 4


# -- a session spanning a weight sync ------------------------------------------------------------------------

SPAN_AGENT = SUPPORT / "harness_span_agent.py"


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
        outcome = super()._wait_for_samples(model)  # the step's batch, or TrainingComplete
        self.taken = getattr(self, "taken", []) + list(getattr(outcome, "samples", []))
        return outcome


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
        verify=noise_verdict,
        env={"SPAN_SIGNALS": str(signals)},
        agent_writable_paths=[str(signals)],  # where the agents and the test signal each other
        agent_columns=["mode"],
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

HUGE_AGENT = SUPPORT / "harness_huge_agent.py"


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
        verify=noise_verdict,
        env={"HUGE_CLAIMS": str(claims)},
        agent_writable_paths=[str(claims)],
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


@pytest.mark.timeout(300)
def test_a_harness_run_evaluates_its_held_out_prompts_through_harness_sessions(
    vllm_server, tiny_model_dir, tmp_path, agent_tmp
):
    worker_side.VERIFIED_HERE.clear()
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
    assert len(worker_side.VERIFIED_HERE) == 3 * 2
    assert not agent_processes(agent_tmp)
    assert not list(agent_tmp.iterdir())
