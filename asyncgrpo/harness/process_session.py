"""ProcessSessionFactory: a local process per rollout, for agents without a sandbox service.

Each session makes a fresh working directory holding `task.json` (the dataset row: the prompt's
messages under "prompt" and the row's other columns, plus the session's "seed", "episode_id" and the
run's "sampling"), starts `command` there with the same JSON on stdin and `OPENAI_BASE_URL`,
`OPENAI_API_KEY` (the session's own key) and `OPENAI_MODEL` pointing at the trainer's capture proxy,
and waits for it to exit. `verify(workdir, transcript)` scores what the agent left behind. The
process leads its own process group, so closing the session ends the agent and every process it
started; the directory is removed with it. The factory's reaper (harness/reaper.py) ends the groups
of a rollout worker that dies without closing its sessions.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncgrpo.harness.capture import CaptureEndpoint
from asyncgrpo.harness.contract import ToolResult, TrainingTrace, VerifyResult
from asyncgrpo.harness.reaper import GroupReaper

# How long an agent may run, by default: a few model turns and tool calls of a small agent, with
# room for a slow, shared server. Longer agents set `timeout_s`.
DEFAULT_TIMEOUT_S = 300.0
# How much of the agent's output a failure warning quotes (its end: where the error is).
OUTPUT_TAIL_CHARS = 2000
# The agent's output, beside its working directory (not in it: verify reads the directory).
OUTPUT_FILE_SUFFIX = ".output.log"


class ProcessSession:
    """One running agent process: an OpenEnv `ResourceSession` and `TrainableSession` by shape.
    Loop-owning: it has no tools of its own to offer a harness."""

    def __init__(
        self,
        command: list[str],
        task: dict[str, Any],
        verify: Callable[[Path, list[dict[str, Any]]], float | None],
        timeout_s: float,
        capture: CaptureEndpoint,
        episode_id: str,
        env: dict[str, str] | None,
        reaper: GroupReaper,
    ):
        self.task = task
        self._reaper = reaper
        self._verify = verify
        self.timeout_s = timeout_s
        self._capture = capture
        self.workdir = Path(tempfile.mkdtemp(prefix="asyncgrpo-harness-"))
        self.output_path = self.workdir.with_name(self.workdir.name + OUTPUT_FILE_SUFFIX)
        self._api_key = capture.open_session(episode_id)
        payload = json.dumps(task, default=str)  # a column json cannot write (a date) as its text
        (self.workdir / "task.json").write_text(payload)
        environment = {
            **os.environ,
            **(env or {}),
            "OPENAI_BASE_URL": capture.base_url,
            "OPENAI_API_KEY": self._api_key,
            "OPENAI_MODEL": capture.model,
        }
        self._output = self.output_path.open("wb")
        try:
            self.process = subprocess.Popen(
                command,
                cwd=self.workdir,
                env=environment,
                stdin=subprocess.PIPE,
                stdout=self._output,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: close() ends its children too
            )
        except OSError:
            self.close()
            raise
        reaper.watch(self.process.pid)  # the group ends with the worker, even a worker killed outright
        try:
            self.process.stdin.write(payload.encode())
            self.process.stdin.close()
        except BrokenPipeError:
            pass  # the agent does not read stdin (or exited already): its exit code tells

    # -- the loop-owning session (OpenEnv's TrainableSession) ---------------------------------------------

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        """The agent's exit code; TimeoutError (the agent ended) when it runs past the timeout."""
        try:
            return self.process.wait(timeout=timeout_s if timeout_s is not None else self.timeout_s)
        except subprocess.TimeoutExpired:
            self._kill()
            raise TimeoutError(f"the agent ran past timeout_s={self.timeout_s:g} s and was ended") from None

    def fetch_training_trace(self) -> TrainingTrace:
        return self._capture.training_trace(self._api_key)

    def output_tail(self) -> str:
        """The end of what the agent wrote to stdout and stderr."""
        if not self._output.closed:  # closed when the trainer stopping closed the session first
            self._output.flush()
        try:
            text = self.output_path.read_bytes()[-OUTPUT_TAIL_CHARS:]
        except FileNotFoundError:
            return ""
        return text.decode(errors="replace")

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
        reward = self._verify(self.workdir, transcript)
        return VerifyResult(env_reward=None if reward is None else float(reward), done=True)

    def close(self) -> None:
        """End the agent and its children, forget its key, remove its files. Safe to call twice."""
        if getattr(self, "process", None) is not None:
            self._kill()
            self.process.wait()
            self._reaper.forget(self.process.pid)
        self._output.close()
        self._capture.close_session(self._api_key)
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.output_path.unlink(missing_ok=True)

    def _kill(self) -> None:
        # The group, even when its leader has exited: a child it left running is still in it.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _absolute_if_file(part: str) -> str:
    """`part` made absolute when it names an existing file (symbolic links kept: a virtualenv's python
    is one, and resolved it would be another interpreter without the venv's packages)."""
    try:
        return str(Path(part).absolute()) if Path(part).is_file() else part
    except OSError:  # not a path at all (a `-c` program, say)
        return part


class ProcessSessionFactory:
    """Sessions running `command` in a fresh directory per rollout (docs/harness.md); an OpenEnv
    `ResourceSessionFactory` by shape.

    `verify(workdir, transcript)` returns the reward (None: the rollout cannot be scored);
    `timeout_s` bounds each agent's run; `env` adds environment variables. An element of `command`
    that names an existing file (the agent's script, relative to where the trainer runs) is made
    absolute: the agent runs in its own working directory. `sampling` (the run's
    sampling settings) and `capture` (the trainer's proxy) are given by the trainer:
    `functools.partial(ProcessSessionFactory, command=[...], verify=...)` is a
    `harness_session_factory`."""

    takes_dataset_row = True  # create() gets the whole dataset row, not the prompt alone

    def __init__(
        self,
        command: list[str],
        verify: Callable[[Path, list[dict[str, Any]]], float | None],
        timeout_s: float = DEFAULT_TIMEOUT_S,
        env: dict[str, str] | None = None,
        sampling: dict[str, Any] | None = None,
        capture: CaptureEndpoint | None = None,
    ):
        if not command or not all(isinstance(part, str) for part in command):
            raise ValueError(
                f"command must be a non-empty list of strings (the agent's argv), got {command!r}"
            )
        if not callable(verify):
            raise ValueError(
                f"verify must be a function verify(workdir, transcript) -> float | None, got {verify!r}"
            )
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0 (seconds an agent may run)")
        # The agent runs in its own directory: a relative path to an existing file (the agent's script,
        # given from the directory the trainer runs in) would name nothing there.
        self.command = [_absolute_if_file(part) for part in command]
        self.verify = verify
        self.timeout_s = timeout_s
        self.env = dict(env or {})
        self.sampling = dict(sampling or {})
        self.capture = capture
        self.reaper = GroupReaper()  # started with the first session

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> ProcessSession:
        if self.capture is None:
            raise ValueError(
                "ProcessSessionFactory has no capture endpoint: give it to HarnessAsyncGRPOTrainer as "
                "harness_session_factory (the trainer binds its proxy), not an instance made by hand"
            )
        row = dict(task) if isinstance(task, dict) else {"prompt": task}
        payload = {**row, "seed": seed, "episode_id": episode_id, "sampling": self.sampling}
        return ProcessSession(
            self.command,
            payload,
            self.verify,
            self.timeout_s,
            self.capture,
            episode_id or "",
            self.env,
            self.reaper,
        )

    def close(self) -> None:
        """End the reaper process (the rollout loop calls this after closing every session)."""
        self.reaper.close()
