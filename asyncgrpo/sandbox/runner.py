"""`run()`: one command in a fresh sandbox, for tools and reward functions that run code the model
wrote (docs/harness.md, "The sandbox").

The command runs in a working folder of its own holding `files`, under `limits`, for at most
`timeout_s`, with no network, and sees nothing of the machine beyond the system's programs and
libraries (asyncgrpo/sandbox/bubblewrap.py). Whatever it does (hang, crash, fork without end, fill
its memory or the disk) is its result, never an exception: `SandboxResult` says how it ended.
Everything it started is gone, and its folder removed, when `run()` returns.

A process that leaves with `os._exit` (the rollout worker, docs/reliability.md) skips the `finally`
of every thread still inside `run()`: it calls `end_every_run()` first, which ends those sandboxes
and removes their folders and cgroups, and refuses new runs.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.sandbox.bubblewrap import HOME, TMP, SandboxCommand, SandboxFolders
from asyncgrpo.sandbox.errors import SandboxError
from asyncgrpo.sandbox.files import disk_usage, remove_tree
from asyncgrpo.sandbox.limits import CODE_LIMITS, WATCH_INTERVAL_S, SandboxLimits

# The PATH inside: the system's programs (give the interpreter as an absolute path, e.g. sys.executable).
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
# The output kept of each stream (its beginning); the rest is read and dropped.
MAX_OUTPUT_BYTES = 2**20
# How long, after the sandbox was killed, its end is waited for: the kernel ends a PID namespace in
# the time it takes to deliver one SIGKILL to each process; only a failing kernel reaches this.
END_BOUND_S = 30.0
# How long end_every_run() waits for the runs it ended to clean up after themselves before it removes
# what they left: their sandbox is killed, so a run's own clean-up takes one reap and one removal.
CLEAN_UP_BOUND_S = 5.0


class _LiveRuns:
    """The runs in progress in this process: their folders and, once started, their sandboxes."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ending = False
        self.runs: dict[Path, _Run] = {}

    def add(self, root: Path) -> _Run:
        with self.lock:
            if self.ending:
                remove_tree(root)
                raise SandboxError("this process is ending (end_every_run() was called): no new sandbox")
            run = self.runs[root] = _Run(root)
            return run

    def started(self, run: _Run, process: subprocess.Popen, sandbox: SandboxCommand) -> None:
        """Record a started sandbox; SandboxError (the sandbox killed) when the process is ending."""
        with self.lock:
            run.process, run.sandbox = process, sandbox
            ending = self.ending
        if ending:
            process.kill()
            process.wait()
            raise SandboxError("this process is ending (end_every_run() was called): the sandbox was ended")

    def done(self, run: _Run) -> None:
        with self.lock:
            self.runs.pop(run.root, None)
        run.cleaned.set()


@dataclass
class _Run:
    root: Path
    process: subprocess.Popen | None = None
    sandbox: SandboxCommand | None = None
    cleaned: threading.Event = field(default_factory=threading.Event)


_live = _LiveRuns()


def end_every_run() -> None:
    """End every sandbox `run()` has running in this process, wait (boundedly) for those runs to clean
    up, then remove what they left: their folders and cgroups. Later calls to `run()` raise
    SandboxError. For a process about to leave with `os._exit`, whose threads never reach their
    `finally`."""
    with _live.lock:
        _live.ending = True
        runs = list(_live.runs.values())
    for run in runs:
        if run.process is not None and run.process.poll() is None:
            run.process.kill()  # bubblewrap's parent-death signal takes its init, the kernel the rest
    deadline = time.monotonic() + CLEAN_UP_BOUND_S
    for run in runs:
        if not run.cleaned.wait(max(0.0, deadline - time.monotonic())):
            if run.process is not None:
                try:
                    run.process.wait(END_BOUND_S)
                except subprocess.TimeoutExpired:  # never raises: its caller is about to leave
                    pass
            if run.sandbox is not None:
                run.sandbox.release()
            remove_tree(run.root)


@dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed command ended. `exit_code`: its exit status (128 + N when killed by signal N,
    as by SIGXCPU past cpu_seconds, or SIGKILL past cpu_seconds' grace); None when the sandbox ended it:
    `timed_out` (past timeout_s) or `over_disk` (its files past disk_bytes). `stdout` and `stderr`:
    the first MAX_OUTPUT_BYTES of each, decoded as UTF-8 (bad bytes replaced)."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    over_disk: bool
    duration_s: float

    @property
    def ok(self) -> bool:
        """It ran to its end and exited 0."""
        return self.exit_code == 0


def run(
    command: Sequence[str],
    files: Mapping[str, str | bytes] | None = None,
    timeout_s: float = 60.0,
    *,
    stdin: str | bytes | None = None,
    limits: SandboxLimits = CODE_LIMITS,
    env: Mapping[str, str] | None = None,
    readable_paths: Sequence[str] = (),
) -> SandboxResult:
    """Run `command` (an argv: give an interpreter by absolute path, e.g. `sys.executable`) in a fresh
    sandbox whose working folder holds `files` (relative path -> text or bytes), with `stdin` as its
    standard input, for at most `timeout_s` seconds, under `limits` (CODE_LIMITS by default). `env` adds
    to its minimal environment (PATH, HOME, TMPDIR, LANG); `readable_paths` are host paths it may read.
    Raises SandboxUnavailableError when this machine cannot start a sandbox (check_available says why),
    ValueError for arguments that are wrong; never for what the command does."""
    command = _checked_command(command)
    if not timeout_s > 0:
        raise ConfigurationError(f"timeout_s={timeout_s} must be > 0 (seconds the command may run)")
    run = _live.add(Path(tempfile.mkdtemp(prefix="asyncgrpo-sandbox-")))  # mode 0700
    try:
        folders = SandboxFolders.make(run.root)
        _write_files(folders.work, files or {})
        input_file = folders.private / "stdin"
        input_file.write_bytes(stdin.encode() if isinstance(stdin, str) else (stdin or b""))
        environment = {"PATH": DEFAULT_PATH, "HOME": HOME, "TMPDIR": TMP, "LANG": "C.UTF-8", **(env or {})}
        options = dict(search_path=environment["PATH"], readable_paths=readable_paths)
        return _run_in(run, folders, command, environment, input_file, limits, timeout_s, options)
    finally:
        remove_tree(run.root)
        _live.done(run)


def _checked_command(command: Sequence[str]) -> list[str]:
    if isinstance(command, str) or not command or not all(isinstance(part, str) for part in command):
        raise ConfigurationError(f"command must be a non-empty list of strings (an argv), got {command!r}")
    return list(command)


def _write_files(work: Path, files: Mapping[str, str | bytes]) -> None:
    for name, content in files.items():
        relative = PurePosixPath(name)
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            raise ConfigurationError(
                f"files: {name!r} must be a path relative to the working folder, without '..'"
            )
        path = work / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)


def _run_in(
    run: _Run,
    folders: SandboxFolders,
    command: list[str],
    environment: dict[str, str],
    input_file: Path,
    limits: SandboxLimits,
    timeout_s: float,
    options: dict,
) -> SandboxResult:
    """Start the sandbox and watch it to its end. Its init holds `ended_write` (bubblewrap's
    --sync-fd): `ended_read` reads end of file once every process of it is gone."""
    ended_read, ended_write = os.pipe()
    sandbox = None
    try:
        sandbox = SandboxCommand(
            folders, command, limits, bwrap_options=["--sync-fd", str(ended_write)], **options
        )
        started = time.monotonic()
        with input_file.open("rb") as stdin:
            process = subprocess.Popen(
                sandbox.argv,
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=environment,
                cwd=folders.work,
                pass_fds=(ended_write,),
                start_new_session=True,
            )
        os.close(ended_write)
        ended_write = -1
        _live.started(run, process, sandbox)
        return _watch(process, ended_read, started, folders, limits, timeout_s)
    finally:
        for fd in (ended_read, ended_write):
            if fd >= 0:
                os.close(fd)
        if sandbox is not None:
            sandbox.release()


def _watch(
    process: subprocess.Popen,
    ended_read: int,
    started: float,
    folders: SandboxFolders,
    limits: SandboxLimits,
    timeout_s: float,
) -> SandboxResult:
    """Collect the sandbox's output; end it at the timeout or past disk_bytes; return once it is gone."""
    output = {process.stdout: bytearray(), process.stderr: bytearray()}
    timed_out = over_disk = False
    with selectors.DefaultSelector() as selector:
        for stream in output:
            selector.register(stream, selectors.EVENT_READ)
        selector.register(ended_read, selectors.EVENT_READ)
        deadline, next_check = started + timeout_s, started + WATCH_INTERVAL_S
        while selector.get_map():
            for key, _ in selector.select(min(WATCH_INTERVAL_S, max(0.0, deadline - time.monotonic()))):
                if key.fileobj == ended_read or not _read_into(key.fileobj, output[key.fileobj]):
                    selector.unregister(key.fileobj)
            now = time.monotonic()
            if process.poll() is not None or now < next_check:
                continue  # ended (what is left is reading its last output), or checked a moment ago
            next_check = now + WATCH_INTERVAL_S
            timed_out = now >= deadline
            over_disk = disk_usage(folders.writable(), limits.disk_bytes) > limits.disk_bytes
            if timed_out or over_disk:
                _end(process, ended_read)
                break
    process.stdout.close()
    process.stderr.close()
    code = process.wait()
    return SandboxResult(
        exit_code=None if timed_out or over_disk else code,
        stdout=output[process.stdout].decode(errors="replace"),
        stderr=output[process.stderr].decode(errors="replace"),
        timed_out=timed_out,
        over_disk=over_disk,
        duration_s=time.monotonic() - started,
    )


def _read_into(stream, kept: bytearray) -> bool:
    """Read what `stream` has, keeping up to MAX_OUTPUT_BYTES; False at its end."""
    data = os.read(stream.fileno(), 1 << 16)
    if len(kept) < MAX_OUTPUT_BYTES:
        kept += data[: MAX_OUTPUT_BYTES - len(kept)]
    return bool(data)


def _end(process: subprocess.Popen, ended_read: int) -> None:
    """Kill the sandbox (bubblewrap's parent-death signal takes its init, and the kernel the rest) and
    wait until its init has let go of the sync descriptor."""
    process.kill()
    with selectors.DefaultSelector() as selector:
        selector.register(ended_read, selectors.EVENT_READ)
        deadline = time.monotonic() + END_BOUND_S
        while time.monotonic() < deadline and selector.select(deadline - time.monotonic()):
            if not os.read(ended_read, 512):
                return
