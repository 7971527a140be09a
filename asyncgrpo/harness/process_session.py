"""ProcessSessionFactory: a local process per rollout, each in a sandbox of its own (bubblewrap:
asyncgrpo/harness/agent_sandbox.py, asyncgrpo/sandbox), for agents without a sandbox service.

Each session makes a private folder (mode 0700) holding the agent's working directory (`work/`), its
home (`home/`) and temporary folder (`tmp/`), all it may write, and its output log (`output.log`, mode
0600, capped), which it never sees. A sandboxed agent whose files pass its `disk_bytes` is ended (its
folders are measured while the session waits for it). The working directory
starts with `task.json`: the prompt's messages under "prompt", the row's columns named in
`agent_columns` (none by default: the answer columns stay with the trainer), and the session's
"seed", "episode_id" and the run's "sampling". The agent starts there with the same JSON on stdin
(the file itself, so nothing waits on the agent reading it), a minimal environment
(harness/agent_environment.py) with `OPENAI_BASE_URL`, `OPENAI_API_KEY` (the session's own key) and
`OPENAI_MODEL` pointing at the trainer's capture proxy, under a supervisor process
(harness/supervisor.py) that ends every process the agent starts when the agent exits, when the
session closes, or when the factory closes or its process dies. `verify(workdir, transcript, row)`
scores what the agent left behind against the trainer's own copy of the dataset row.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.harness.agent_environment import agent_environment, default_max_agents
from asyncgrpo.harness.agent_sandbox import SANDBOXED, AgentSandbox
from asyncgrpo.harness.agent_sandbox import agent_sandbox as _agent_sandbox
from asyncgrpo.harness.agent_sandbox import ready as _sandbox_ready
from asyncgrpo.harness.capture import CaptureEndpoint
from asyncgrpo.harness.contract import ToolResult, TrainingTrace, VerifyResult
from asyncgrpo.sandbox import SandboxLimits
from asyncgrpo.sandbox.files import disk_usage, remove_tree
from asyncgrpo.sandbox.limits import WATCH_INTERVAL_S

# How long an agent may run, by default: a few model turns and tool calls of a small agent, with
# room for a slow, shared server. Longer agents set `timeout_s`.
DEFAULT_TIMEOUT_S = 300.0
# How much of the agent's output a failure warning quotes (its end: where the error is).
OUTPUT_TAIL_CHARS = 2000
# What an agent's log keeps at most (its latest output): many turns of a chatty agent, and a log a
# looping agent cannot grow without bound.
OUTPUT_CAP_BYTES = 2**20
# How long closing a session waits for the supervisor to end the agent's processes before it kills
# the supervisor's process group itself. Ending takes a few system calls per process; only a
# supervisor stopped or killed by its agent needs the fallback.
END_BOUND_S = 30.0
SUPERVISOR = Path(__file__).with_name("supervisor.py")
POLL_LIMIT_MS = 2**31 - 1  # poll()'s largest timeout
# task.json keys the session writes itself: a column of these names cannot be given to the agent.
SESSION_KEYS = ("prompt", "seed", "episode_id", "sampling")


class ProcessSession:
    """One running agent process: an OpenEnv `ResourceSession` and `TrainableSession` by shape.
    Loop-owning: it has no tools of its own to offer a harness."""

    def __init__(
        self,
        command: list[str],
        task: dict[str, Any],
        row: dict[str, Any],
        verify: Callable[..., float | None],
        verify_takes_row: bool,
        timeout_s: float,
        capture: CaptureEndpoint,
        episode_id: str,
        env: dict[str, str],
        lifeline: int,
        sandbox: AgentSandbox | None = None,
    ):
        self.task = task
        self.row = row
        self._verify, self._verify_takes_row = verify, verify_takes_row
        self.timeout_s = timeout_s
        self._capture = capture
        self._lock = threading.Lock()  # the supervisor is reaped under it, and signalled only before
        self._pidfd: int | None = None
        self.root = Path(tempfile.mkdtemp(prefix="asyncgrpo-harness-"))  # mode 0700: private
        self.workdir = self.root / "work"
        self.output_path = self.root / "output.log"
        self._api_key: str | None = None
        self._sandbox = sandbox
        self._sandbox_command = None
        try:
            self._api_key = capture.open_session(episode_id)
            self.workdir.mkdir()
            (self.root / "tmp").mkdir()
            task_file = self.workdir / "task.json"
            # default=str: a column json cannot write (a date) goes as its text
            task_file.write_text(json.dumps(task, default=str))
            environment = agent_environment(
                self.root / "tmp" if sandbox is None else sandbox.temp_dir,
                env,
                {
                    "OPENAI_BASE_URL": capture.base_url if sandbox is None else sandbox.base_url,
                    "OPENAI_API_KEY": self._api_key,
                    "OPENAI_MODEL": capture.model,
                },
                home=None if sandbox is None else sandbox.home,
            )
            if sandbox is not None:
                socket = getattr(capture, "unix_socket", None)
                self._sandbox_command = sandbox.command(self.root, command, environment.get("PATH"), socket)
                command = self._sandbox_command.argv
            log = os.open(self.output_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                with task_file.open("rb") as stdin:
                    self.process = subprocess.Popen(
                        [sys.executable, "-I", "-S", str(SUPERVISOR), str(lifeline), str(OUTPUT_CAP_BYTES)]
                        + ["--", *command],
                        cwd=self.workdir,
                        env=environment,
                        stdin=stdin,
                        stdout=log,
                        stderr=log,
                        pass_fds=(lifeline,),
                        start_new_session=True,  # its own process group, apart from the worker's signals
                    )
            finally:
                os.close(log)
            # Not reaped until this session reaps it: the pid is the supervisor's while the descriptor lives.
            self._pidfd = os.pidfd_open(self.process.pid)
        except BaseException:
            self.close()
            raise
        self.started = time.monotonic()

    # -- the loop-owning session (OpenEnv's TrainableSession) ---------------------------------------------

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        """The agent's exit code; TimeoutError (the agent ended) when it runs past the timeout, counted
        from the agent's start (`timeout_s` of the factory when not given). A sandboxed agent whose
        files pass its `disk_bytes` is ended (a non-zero code; its log says why)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = self.started + limit
        watch = self._sandbox_command is not None
        while not self._exited_within(min(deadline - time.monotonic(), WATCH_INTERVAL_S if watch else limit)):
            if time.monotonic() >= deadline:
                self._end()
                raise TimeoutError(f"the agent ran past timeout_s={limit:g} s and was ended")
            if watch and self._over_disk():
                break
        with self._lock:
            return self.process.wait()

    def _over_disk(self) -> bool:
        """Whether the agent's files passed its disk_bytes; if so it is ended, and its log says why."""
        bound = self._sandbox.limits.disk_bytes
        used = disk_usage(self._sandbox_command.folders.writable(), bound)
        if used <= bound:
            return False
        self._end()
        with self.output_path.open("ab") as log:
            log.write(
                f"\nasyncgrpo sandbox: the agent's files passed agent_limits.disk_bytes={bound} bytes "
                f"({used} counted); it was ended\n".encode()
            )
        return True

    def fetch_training_trace(self) -> TrainingTrace:
        return self._capture.training_trace(self._api_key)

    def output_tail(self) -> str:
        """The end of what the agent wrote to stdout and stderr."""
        try:
            with self.output_path.open("rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - OUTPUT_TAIL_CHARS))
                return log.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    # -- ResourceSession --------------------------------------------------------------------------------

    def initial_messages(self) -> list[dict[str, Any]]:
        return list(self.task.get("prompt") or [])

    def list_tools(self) -> list:
        return []  # the agent brings its own tools

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult(
            error=f"a process session offers no tools (asked for {name!r}): the agent runs its own"
        )

    def verify(self, transcript: list[dict[str, Any]], final_state: Any | None = None) -> VerifyResult:
        if self._verify_takes_row:
            reward = self._verify(self.workdir, transcript, self.row)
        else:
            reward = self._verify(self.workdir, transcript)
        return VerifyResult(env_reward=None if reward is None else float(reward), done=True)

    def close(self) -> None:
        """End the agent and every process it started, forget its key, remove its files. Safe to call
        twice, and from another thread than the one waiting for the agent."""
        if getattr(self, "process", None) is not None:
            self._end()
        with self._lock:  # one closer takes the descriptor
            pidfd, self._pidfd = self._pidfd, None
        if pidfd is not None:
            os.close(pidfd)
        if self._api_key is not None:
            self._capture.close_session(self._api_key)
        if self._sandbox_command is not None:
            self._sandbox_command.release()
        remove_tree(self.root)

    # -- the supervisor -----------------------------------------------------------------------------------

    def _exited_within(self, seconds: float) -> bool:
        """Whether the supervisor exits within `seconds` (it is not reaped: only _end and
        wait_for_completion reap it, under the lock)."""
        pidfd = self._pidfd
        if self.process.returncode is not None or pidfd is None:  # reaped (close() came first)
            return True
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)  # readable once the process has exited
        return bool(poller.poll(min(POLL_LIMIT_MS, max(0, int(seconds * 1000)))))

    def _end(self) -> None:
        """Have the supervisor end the agent's processes, then reap it. Every signal goes out before the
        reap: a pid or group id is never reused while its process is not reaped, so no signal here
        can reach another program's process."""
        with self._lock:
            if self.process.returncode is not None:
                return  # reaped: the supervisor ended every process of the agent's before it exited
            if self._pidfd is None:  # the session failed to start: nothing ran but the supervisor
                self.process.kill()
                self.process.wait()
                return
            self._signal(signal.SIGTERM)
            self._signal(signal.SIGCONT)  # an agent may have stopped its supervisor
            if not self._exited_within(END_BOUND_S):
                self._signal(signal.SIGKILL)
            try:
                os.killpg(self.process.pid, signal.SIGKILL)  # what is left in its group, if anything
            except (ProcessLookupError, PermissionError):
                pass
            self.process.wait()

    def _signal(self, signum: int) -> None:
        try:
            signal.pidfd_send_signal(self._pidfd, signum)
        except ProcessLookupError:
            pass


def _absolute_if_file(part: str) -> str:
    """`part` made absolute when it names an existing file (symbolic links kept: a virtualenv's python
    is one, and resolved it would be another interpreter without the venv's packages)."""
    try:
        return str(Path(part).absolute()) if Path(part).is_file() else part
    except OSError:  # not a path at all (a `-c` program, say)
        return part


def takes_row(verify: Callable) -> bool:
    """Whether `verify` takes a third positional argument (the dataset row)."""
    try:
        parameters = list(inspect.signature(verify).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in parameters)


class ProcessSessionFactory:
    """Sessions running `command` in a fresh directory per rollout (docs/harness.md); an OpenEnv
    `ResourceSessionFactory` by shape.

    `verify(workdir, transcript, row)` returns the reward (None: the rollout cannot be scored); `row`
    is the trainer's own copy of the dataset row, answers included (a verify of two parameters,
    `verify(workdir, transcript)`, works too). The agent sees the prompt and only the columns named
    in `agent_columns`. `timeout_s` bounds each agent's run, from its start; `env` adds environment
    variables to the agent's minimal environment; `max_agents` bounds the agents alive at once (None:
    from the machine, harness/agent_environment.py). An element of `command` that names an existing
    file (the agent's script, relative to where the trainer runs) is made absolute: the agent runs in
    its own working directory. `sampling` (the run's sampling settings) and `capture` (the trainer's
    proxy) are given by the trainer: `functools.partial(ProcessSessionFactory, command=[...],
    verify=...)` is a `harness_session_factory`.

    Every agent runs in a sandbox (`agent_sandbox="bubblewrap"`, docs/harness.md "The sandbox"): its
    folder and the capture proxy are all it sees of the machine. `agent_limits` (a SandboxLimits) bounds
    its memory, processes, files and CPU time; `agent_readable_paths` and `agent_writable_paths` are
    host paths it may read, or write, beyond its own. `agent_sandbox="none"` opts out, with a warning."""

    takes_dataset_row = True  # create() gets the whole dataset row, not the prompt alone

    def __init__(
        self,
        command: list[str],
        verify: Callable[..., float | None],
        timeout_s: float = DEFAULT_TIMEOUT_S,
        env: dict[str, str] | None = None,
        agent_columns: Sequence[str] | None = None,
        max_agents: int | None = None,
        sampling: dict[str, Any] | None = None,
        capture: CaptureEndpoint | None = None,
        agent_sandbox: str = SANDBOXED,
        agent_limits: SandboxLimits | None = None,
        agent_readable_paths: Sequence[str] | None = None,
        agent_writable_paths: Sequence[str] | None = None,
    ):
        if not command or not all(isinstance(part, str) for part in command):
            raise ConfigurationError(
                f"command must be a non-empty list of strings (the agent's argv), got {command!r}"
            )
        if not callable(verify):
            raise ConfigurationError(
                f"verify must be a function verify(workdir, transcript, row) -> float | None, got {verify!r}"
            )
        if not timeout_s > 0:
            raise ConfigurationError(f"timeout_s={timeout_s} must be > 0 (seconds an agent may run)")
        columns = list(agent_columns or [])
        if isinstance(agent_columns, str) or not all(isinstance(name, str) for name in columns):
            raise ConfigurationError(f"agent_columns must be a list of column names, got {agent_columns!r}")
        reserved = [name for name in columns if name in SESSION_KEYS]
        if reserved:
            raise ConfigurationError(
                f"agent_columns names {reserved}: task.json sets {', '.join(SESSION_KEYS)} itself (the "
                "prompt always goes to the agent); rename the dataset column"
            )
        if max_agents is not None and max_agents < 1:
            raise ConfigurationError(f"max_agents={max_agents} must be >= 1 (agent processes alive at once)")
        # The agent runs in its own directory: a relative path to an existing file (the agent's script,
        # given from the directory the trainer runs in) would name nothing there.
        self.command = [_absolute_if_file(part) for part in command]
        self.verify = verify
        self.verify_takes_row = takes_row(verify)
        self.timeout_s = timeout_s
        self.env = {str(name): str(value) for name, value in (env or {}).items()}
        self.agent_columns = columns
        # Read by the harness rollout loop: sessions of this factory alive at once.
        self.max_live_sessions = max_agents if max_agents is not None else default_max_agents()
        self.sampling = dict(sampling or {})
        self.capture = capture
        self.sandbox = self.check_before_rollouts(
            agent_sandbox, agent_limits, agent_readable_paths, agent_writable_paths
        )
        self._lifeline: tuple[int, int] | None = None  # made with the first session
        self._lifeline_lock = threading.Lock()

    @staticmethod
    def check_before_rollouts(
        agent_sandbox: str = SANDBOXED,
        agent_limits: SandboxLimits | None = None,
        agent_readable_paths: Sequence[str] | None = None,
        agent_writable_paths: Sequence[str] | None = None,
        **_other_options: Any,
    ) -> AgentSandbox | None:
        """The sandbox these options ask for, once this machine is known to start it (else
        SandboxUnavailableError, naming what to install or set); None for `agent_sandbox="none"`, warned
        about once per process. The trainer calls it with the factory's options when it is built."""
        sandbox = _agent_sandbox(agent_sandbox, agent_limits, agent_readable_paths, agent_writable_paths)
        _sandbox_ready(sandbox)
        return sandbox

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> ProcessSession:
        if self.capture is None:
            raise ConfigurationError(
                "ProcessSessionFactory has no capture endpoint: give it to HarnessAsyncGRPOTrainer as "
                "harness_session_factory (the trainer binds its proxy), not an instance made by hand"
            )
        row = dict(task) if isinstance(task, dict) else {"prompt": task}
        missing = [name for name in self.agent_columns if name not in row]
        if missing:
            raise ConfigurationError(
                f"agent_columns names {missing}, which the dataset row lacks (it has {sorted(row)})"
            )
        payload = {
            "prompt": row.get("prompt"),
            **{name: row[name] for name in self.agent_columns},
            "seed": seed,
            "episode_id": episode_id,
            "sampling": self.sampling,
        }
        return ProcessSession(
            self.command,
            payload,
            copy.deepcopy(row),  # the verifier's copy: nothing the agent does reaches it
            self.verify,
            self.verify_takes_row,
            self.timeout_s,
            self.capture,
            episode_id or "",
            self.env,
            self._lifeline_read_end(),
            self.sandbox,
        )

    def close(self) -> None:
        """Close the lifeline: every supervisor still running ends its agent's processes (the rollout
        loop calls this after closing every session; a dying worker's kernel does it too)."""
        with self._lifeline_lock:
            if self._lifeline is not None:
                for fd in self._lifeline:
                    os.close(fd)
                self._lifeline = None

    def _lifeline_read_end(self) -> int:
        with self._lifeline_lock:
            if self._lifeline is None:
                self._lifeline = os.pipe()  # not inheritable: only the supervisors are given the read end
            return self._lifeline[0]
