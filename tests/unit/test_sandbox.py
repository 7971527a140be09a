"""The sandbox of agents and model-written code (docs/harness.md, "The sandbox"), without a vLLM server:
what a hostile agent finds of the machine and reaches from inside (and, as the control, without it),
how far its limits let it go and how it ends, an honest OpenAI agent through the bridge to the capture
proxy, the opt-out and its warning, the check at the trainer's build, and `asyncgrpo.sandbox.run`."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support_paths import SUPPORT

pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

from test_harness_units import FakeCapture, descendants, pid_alive, stub_sampler, wait_until  # noqa: E402

from asyncgrpo import sandbox  # noqa: E402
from asyncgrpo.harness import ProcessSessionFactory, agent_sandbox  # noqa: E402
from asyncgrpo.harness.capture import CaptureProxy  # noqa: E402
from asyncgrpo.sandbox import SandboxLimits, SandboxUnavailableError  # noqa: E402
from asyncgrpo.sandbox import cgroup as sandbox_cgroup  # noqa: E402
from asyncgrpo.sandbox import check as sandbox_check  # noqa: E402

TESTS = SUPPORT
SPY, HOG = TESTS / "sandbox_spy_agent.py", TESTS / "sandbox_hog_agent.py"
# Bounds, not waits: only a failing test reaches them.
RUN_BOUND_S, KILL_DELIVERY_BOUND_S = 120.0, 10.0
SECRETS = {"HF_TOKEN": "hf_planted_sandbox", "AWS_SECRET_ACCESS_KEY": "aws-planted-sandbox"}
ANSWER = "1729"
PROMPT = [{"role": "user", "content": "Which taxicab number is the smallest? (row 7)"}]


def sandbox_cgroups() -> list[Path]:
    """The sandbox cgroups this process has left (none: each is removed with its sandbox)."""
    if not sandbox_cgroup.needs_cgroup():
        return []
    return list(sandbox_cgroup.cgroup_base().glob(f"asyncgrpo-sandbox-{os.getpid()}-*"))


# A trainer's process as a new user's run leaves it: started with secrets in its environment and HOME,
# in the folder of the training data, which it holds open.
TRAINER_STAND_IN = "f = open('train.jsonl'); import sys; sys.stdin.read()"


@pytest.fixture
def trainer_machine(tmp_path, monkeypatch):
    """The machine an agent runs on: a trainer process (secrets in its environment, a Hub token under its
    HOME, the training data with the answers in its working folder and open), a local service."""
    home = tmp_path / "home"
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "token").write_text("hf_planted_token_file")
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(json.dumps({"prompt": PROMPT, "answer": ANSWER}) + "\n")
    environment = {**os.environ, **SECRETS, "HOME": str(home)}
    for name, value in SECRETS.items():  # this process's too
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(data)
    agents = tmp_path / "agents"
    agents.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(agents))
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER_STAND_IN], cwd=data, env=environment, stdin=subprocess.PIPE
    )
    try:
        with socket.create_server(("127.0.0.1", 0)) as service:
            yield {"service_port": service.getsockname()[1], "data": data, "agents": agents}
    finally:
        trainer.stdin.close()
        trainer.wait()


def run_agent(program: Path, arguments: list[str], **options):
    """(exit code, the session's working folder's files as {name: text}, its output) of one agent."""
    factory = ProcessSessionFactory(
        [sys.executable, str(program), *arguments],
        lambda workdir, transcript: 1.0,
        timeout_s=RUN_BOUND_S,
        capture=FakeCapture(),
        **options,
    )
    session = factory.create({"prompt": PROMPT, "answer": ANSWER})
    try:
        code = session.wait_for_completion()
        files = {path.name: path.read_text() for path in session.workdir.glob("*.json")}
        processes = descendants(session.process.pid)
        return code, files, session.output_tail(), processes
    finally:
        session.close()
        factory.close()


def test_a_hostile_agent_finds_nothing_of_the_machine_and_reaches_nothing(trainer_machine):
    planted = [*SECRETS.values()]
    code, files, output, _ = run_agent(SPY, [json.dumps(planted)])
    assert code == 0, output
    found = json.loads(files["findings.json"])
    assert found["secrets"] == [] and found["tokens"] == [] and found["data"] == [], found
    assert found["ports"] == [], "no port of the machine's loopback, its own bridge aside (none here)"
    # Its own namespace's processes only: bubblewrap's init, the sandbox's first process, itself.
    assert found["processes"] <= 3, found
    assert not list(trainer_machine["agents"].iterdir()) and not sandbox_cgroups()


def test_without_the_sandbox_the_same_agent_finds_everything(trainer_machine):
    """The control: the spy does find what it looks for where nothing stops it (agent_sandbox="none")."""
    code, files, output, _ = run_agent(SPY, [json.dumps([*SECRETS.values()])], agent_sandbox="none")
    assert code == 0, output
    found = json.loads(files["findings.json"])
    assert set(SECRETS.values()) <= set(found["secrets"])
    assert "hf_planted_token_file" in found["tokens"]
    assert {"path": str(trainer_machine["data"] / "train.jsonl"), "answer": ANSWER} in found["data"]
    assert trainer_machine["service_port"] in found["ports"]


HOG_LIMITS = SandboxLimits(
    memory_bytes=512 * 2**20, processes=32, cpu_seconds=120, file_bytes=16 * 2**20, disk_bytes=64 * 2**20
)


def test_a_hostile_agent_is_held_to_its_limits_and_ended_past_its_disk(trainer_machine):
    code, files, output, processes = run_agent(HOG, [], agent_limits=HOG_LIMITS)
    assert code != 0 and f"agent_limits.disk_bytes={HOG_LIMITS.disk_bytes}" in output, output
    report = json.loads(files["hog.json"])
    # Forks stop at the bound on processes (the sandbox's init and first process, the agent: 3 of them).
    assert report["fork"]["error"] and report["fork"]["children"] <= HOG_LIMITS.processes - 3, report
    assert report["memory"]["error"] == "MemoryError" and report["memory"]["bytes"] < HOG_LIMITS.memory_bytes
    assert report["file"]["error"] == "File too large" and report["file"]["bytes"] == HOG_LIMITS.file_bytes
    # Everything it started ended with it; its folder and its cgroup are gone.
    assert wait_until(lambda: not any(map(pid_alive, processes)), KILL_DELIVERY_BOUND_S)
    assert not list(trainer_machine["agents"].iterdir()) and not sandbox_cgroups()


HONEST_AGENT = """
import json, os, pathlib
from openai import APIStatusError, OpenAI
client = OpenAI(max_retries=0)
task = json.loads(pathlib.Path("task.json").read_text())
replies = []
for _ in range(2):  # two requests on one kept-alive connection through the bridge
    reply = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=task["prompt"])
    replies.append(reply.choices[0].message.content)
try:
    client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=[
        {"role": "user", "content": "x" * 3 * 2**20}])
except APIStatusError as error:
    replies.append(error.status_code)
pathlib.Path("replies.json").write_text(json.dumps(replies))
"""


def test_an_honest_openai_agent_reaches_the_capture_proxy_through_the_bridge(
    tokenizer, tmp_path, monkeypatch
):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))

    async def scenario():
        proxy = CaptureProxy(
            tokenizer, stub_sampler(tokenizer), "tiny", {"enable_thinking": False}, False, 2**20
        )
        endpoint = await proxy.start()
        factory = ProcessSessionFactory(
            [sys.executable, "-c", HONEST_AGENT], lambda w, t: 1.0, timeout_s=RUN_BOUND_S, capture=endpoint
        )
        try:
            session = await asyncio.to_thread(factory.create, {"prompt": PROMPT}, episode_id="ep")
            try:
                code = await asyncio.to_thread(session.wait_for_completion)
                replies = (
                    (session.workdir / "replies.json").read_text() if code == 0 else session.output_tail()
                )
                return code, replies, session.fetch_training_trace()
            finally:
                await asyncio.to_thread(session.close)
        finally:
            factory.close()
            await proxy.stop()

    code, replies, trace = asyncio.run(scenario())
    assert code == 0, replies
    assert json.loads(replies) == ["Hello.", "Hello.", 413]  # the proxy's own refusal, through the bridge
    assert [turn.node_id for turn in trace.turns] == ["ep-0", "ep-1"]
    assert not list(tmp_path.iterdir()), "the proxy's socket folder and the session's are removed"


def test_the_opt_out_is_by_name_and_warned_about_once(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(agent_sandbox, "_warned_unsandboxed", False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    make = functools.partial(
        ProcessSessionFactory, [sys.executable, "-c", "pass"], lambda w, t: 1.0, capture=FakeCapture()
    )
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.harness.agent_sandbox"):
        for _ in range(2):
            factory = make(agent_sandbox="none")
            session = factory.create({"prompt": PROMPT})
            assert session.wait_for_completion() == 0
            session.close()
            factory.close()
    (record,) = caplog.records
    assert "agent_sandbox='none'" in record.getMessage() and "without a sandbox" in record.getMessage()
    with pytest.raises(ValueError, match="use 'bubblewrap'"):
        make(agent_sandbox="docker")
    with pytest.raises(ValueError, match="agent_limits bound the agent's sandbox"):
        make(agent_sandbox="none", agent_limits=SandboxLimits())
    with pytest.raises(ValueError, match="processes=1 must be >= 2"):
        SandboxLimits(processes=1)
    with pytest.raises(ValueError, match="which do not exist"):
        make(agent_readable_paths=[str(tmp_path / "missing")])
    with pytest.raises(sandbox.SandboxError, match="holds the home folder"):
        sandbox.run([sys.executable, "-c", "pass"], readable_paths=[os.path.expanduser("~")])


def test_a_machine_that_cannot_start_the_sandbox_is_told_at_the_trainers_build(monkeypatch, tmp_path):
    from asyncgrpo import HarnessAsyncGRPOTrainer
    from asyncgrpo.rewards import code_execution_reward

    monkeypatch.setattr(sandbox_check, "_checked", False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    factory = functools.partial(ProcessSessionFactory, command=[sys.executable, "agent.py"], verify=print)
    # Raised before the model is even looked for: "no-such-model" would be the next error.
    with pytest.raises(SandboxUnavailableError, match="apt-get install bubblewrap"):
        HarnessAsyncGRPOTrainer(model="no-such-model", train_dataset=[{}], harness_session_factory=factory)
    with pytest.raises(SandboxUnavailableError, match="apt-get install bubblewrap"):
        code_execution_reward.check_before_rollouts()
    with pytest.raises(SandboxUnavailableError):
        sandbox.run([sys.executable, "-c", "pass"])
    # A kernel that refuses user namespaces: the message says which setting allows them.
    monkeypatch.setattr(sandbox_check, "_read", lambda path: "0" if "max_user_namespaces" in path else None)
    message = sandbox_check._diagnosis("bwrap: No permissions to create a new namespace", timed_out=False)
    assert "sudo sysctl -w user.max_user_namespaces" in message and "No permissions" in message


def test_run_gives_the_command_its_files_and_input_and_nothing_of_the_machine(tmp_path):
    readable = tmp_path / "shared.txt"
    readable.write_text("shared")
    program = (
        "import os, sys; print(open('data/in.txt').read(), sys.stdin.read(), open(sys.argv[1]).read(), "
        "os.getcwd(), os.path.exists(os.path.expanduser('~/.cache')), sorted(os.listdir('/sandbox'))); "
        "print('to stderr', file=sys.stderr); sys.exit(3)"
    )
    result = sandbox.run(
        [sys.executable, "-c", program, str(readable)],
        {"data/in.txt": "file"},
        stdin="input",
        readable_paths=[str(readable)],
    )
    assert result.exit_code == 3 and not result.ok and not result.timed_out and not result.over_disk
    assert result.stdout.split() == [
        "file",
        "input",
        "shared",
        "/sandbox/work",
        "False",
        "['home',",
        "'work']",
    ]
    assert result.stderr == "to stderr\n"
    hang = sandbox.run([sys.executable, "-c", "import time; time.sleep(600)"], timeout_s=1)
    assert hang.timed_out and hang.exit_code is None and hang.duration_s < RUN_BOUND_S
    with pytest.raises(ValueError, match="relative to the working folder"):
        sandbox.run(["true"], {"../escape": "x"})
    with pytest.raises(ValueError, match="non-empty list of strings"):
        sandbox.run("python -c pass")
    assert not sandbox_cgroups()


# A process like the rollout worker: a thread (a reward function) inside run() when the process leaves
# with os._exit. It reports the sandbox's pid namespace init, run()'s folder, and what a run asked for
# after end_every_run() raised, then leaves as the worker does.
ENDING_PROCESS = """
import glob, json, os, sys, tempfile, threading, time
from asyncgrpo.sandbox import SandboxError, run
from asyncgrpo.sandbox.runner import end_every_run
threading.Thread(target=run, args=([sys.executable, "-c", "import time; time.sleep(600)"],),
                 kwargs={"timeout_s": 600}, daemon=True).start()
deadline = time.monotonic() + 60
while not glob.glob(os.path.join(tempfile.gettempdir(), "asyncgrpo-sandbox-*", "work")):
    assert time.monotonic() < deadline, "the sandbox's folder never appeared"
    time.sleep(0.05)
time.sleep(1)  # the sandbox starts
end_every_run()
try:
    run(["true"])
    refused = None
except SandboxError as error:
    refused = str(error)
print(json.dumps({"refused": refused}), flush=True)
os._exit(0)
"""


def test_end_every_run_ends_the_sandboxes_of_a_process_leaving_with_os_exit(tmp_path):
    # The child leaves with os._exit, so the thread inside run() never reaches its finally: before the
    # fix (a worker stopped while a code-execution reward ran) its folder and cgroup stayed behind.
    marker = "sandbox-ending-marker"
    program = ENDING_PROCESS.replace("time.sleep(600)", f"time.sleep(600)  # {marker}")
    child = subprocess.Popen(
        [sys.executable, "-c", program],
        env={**os.environ, "TMPDIR": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = child.communicate(timeout=RUN_BOUND_S)
    assert child.returncode == 0, err
    assert "this process is ending" in json.loads(out)["refused"]
    assert list(tmp_path.iterdir()) == [], "run()'s folder removed though its thread never returned"
    assert wait_until(lambda: not processes_with(marker), KILL_DELIVERY_BOUND_S), processes_with(marker)
    if sandbox_cgroup.needs_cgroup():  # as root, the sandbox's cgroup is named by the child's pid
        assert not list(sandbox_cgroup.cgroup_base().glob(f"asyncgrpo-sandbox-{child.pid}-*"))


def processes_with(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_text():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


FORK_WITHOUT_END = (
    "import os, time\nn = 0\ntry:\n    while n < 500:\n        if os.fork() == 0:\n"
    "            time.sleep(60)\n            os._exit(0)\n        n += 1\nexcept OSError:\n    print(n)\n"
)
UNPRIVILEGED_PROBE = f"""
import sys
from asyncgrpo.sandbox import SandboxLimits, check_available, run
from asyncgrpo.sandbox.cgroup import needs_cgroup
check_available()
result = run([sys.executable, "-c", {FORK_WITHOUT_END!r}], timeout_s=60, limits=SandboxLimits(processes=16))
print(needs_cgroup(), result.exit_code, result.stdout.strip(), result.stderr.strip())
"""
NOBODY = 65534


def readable_by_everyone(path: Path) -> bool:
    """Whether every user may reach and read `path` (each folder above it searchable by others)."""
    path = path.resolve()
    folders_ok = all(folder.stat().st_mode & 0o001 for folder in path.parents)
    return folders_ok and path.stat().st_mode & 0o005 == 0o005


def interpreter_for_everyone() -> str | None:
    """A Python `nobody` may run, with its standard library: the suite's own when it is installed where
    everyone may read it, else the system's python3."""
    import shutil
    import sysconfig

    candidates = [(sys.executable, sysconfig.get_paths()["stdlib"])]
    system = shutil.which("python3", path=os.pathsep.join(["/usr/local/bin", "/usr/bin", "/bin"]))
    if system:
        candidates.append((system, system))
    for interpreter, stdlib in candidates:
        if readable_by_everyone(Path(interpreter)) and readable_by_everyone(Path(stdlib)):
            return str(Path(interpreter).resolve())  # the installation itself, not a virtual environment
    return None


def test_an_unprivileged_user_gets_the_same_sandbox_and_its_bound_on_processes(tmp_path):
    """A cluster node's case: the trainer runs as an ordinary user, bubblewrap makes a user namespace
    unprivileged, and RLIMIT_NPROC (counted in that namespace) bounds the sandbox's processes, no cgroup.
    As root (CI), the probe runs as `nobody`: the sandbox's package copied where that user may read it,
    run by the system's Python (the standard library is all the sandbox needs)."""
    import shutil
    import tempfile

    probe = [sys.executable, "-I", "-c", UNPRIVILEGED_PROBE]
    if os.geteuid() == 0:
        interpreter = interpreter_for_everyone()
        assert interpreter and shutil.which("setpriv"), "needs a Python every user may run, and setpriv"
        folder = Path(tempfile.mkdtemp(prefix="asyncgrpo-unprivileged-"))  # the usual temporary folder
        try:
            package = folder / "asyncgrpo"
            shutil.copytree(Path(sandbox.__file__).parent, package / "sandbox")
            (package / "__init__.py").write_text("")
            work = folder / "tmp"
            work.mkdir()
            os.chown(work, NOBODY, NOBODY)
            for path in [folder, *folder.rglob("*")]:
                os.chmod(path, 0o755 if path.is_dir() else 0o644)
            os.chmod(work, 0o700)
            user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
            environment = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(folder), "TMPDIR": str(work)}
            probe = [*user, interpreter, "-c", UNPRIVILEGED_PROBE]
            answer = subprocess.run(
                probe, env=environment, capture_output=True, text=True, timeout=RUN_BOUND_S
            )
        finally:
            shutil.rmtree(folder)
    else:
        answer = subprocess.run(probe, capture_output=True, text=True, timeout=RUN_BOUND_S)
    assert answer.returncode == 0, answer.stderr
    cgroup, code, forks, stderr = (answer.stdout.split() + ["", "", "", ""])[:4]
    # No cgroup, and forks stop at 16 processes: bubblewrap's init, the first process, the command, 13.
    assert (cgroup, code, forks) == ("False", "0", "13"), answer.stdout
