"""The bubblewrap command line of a sandbox: what the sandboxed program sees of the machine.

Inside: new user, PID, mount, IPC, UTS, cgroup and network namespaces, as user `agent` (uid 1000
inside, the trainer's own user outside, with no capability outside its namespace and no way to make
another namespace); an empty root, read-only, with

- the system's programs and libraries read-only (`/usr`, `/bin`, `/lib`...), a few files of `/etc`
  that programs read to run (the dynamic linker's cache, certificates, time zones; no password
  hashes, no machine's configuration), and a `passwd`, `group` and `hosts` of its own;
- the interpreter that runs the sandbox and the command's program, read-only: the Python's
  install and virtual environment (as the interpreter says: `sys.prefix` and its kin), the
  command's files (the agent's script), and the paths the user names; never a folder that holds the
  trainer user's home (refused with SandboxError);
- its own folders, writable, from the host folders the caller made: the working directory
  (`/sandbox/work`), a home (`/sandbox/home`) and a temporary folder (`/tmp`); `/dev` with the usual
  devices only, and a small `/dev/shm`;
- a `/proc` of its own PID namespace: no process of the machine is visible, nor their environments,
  working directories or open files;
- no network interface but its own loopback; the capture proxy's Unix socket, when given, is bound
  at `PROXY_SOCKET` and bridged to 127.0.0.1:PROXY_PORT by the sandbox's first process
  (asyncgrpo/sandbox/inside.py).

The sandbox dies with its parent (`--die-with-parent`), and everything in it when its first process
exits (the PID namespace's init ends, and the kernel kills the rest).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from asyncgrpo.sandbox.cgroup import SandboxCgroup, needs_cgroup
from asyncgrpo.sandbox.errors import SandboxError, SandboxUnavailableError
from asyncgrpo.sandbox.limits import MiB, SandboxLimits

# Where things are inside the sandbox.
WORK, HOME, TMP = "/sandbox/work", "/sandbox/home", "/tmp"
PROXY_SOCKET = "/run/asyncgrpo/proxy.sock"
LAUNCHER = "/run/asyncgrpo/launcher.py"
# The port the bridge to the capture proxy listens on, in the sandbox's own loopback (nothing else
# listens there; away from the ports a program's own test server would take).
PROXY_PORT = 41180
SANDBOX_UID = SANDBOX_GID = 1000
SANDBOX_USER = "agent"
INSIDE = Path(__file__).with_name("inside.py")
# The system's programs and libraries (on a merged-/usr system, all but /usr are links into it).
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# What of /etc programs read to run; the rest (password hashes, SSH host keys, the machine's
# services) stays out.
ETC_ENTRIES = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    "ssl",
    "ca-certificates",
    "ca-certificates.conf",
    "pki",
    "crypto-policies",
    "localtime",
    "timezone",
    "nsswitch.conf",
    "host.conf",
    "gai.conf",
    "protocols",
    "services",
    "mime.types",
    "os-release",
    "debian_version",
    "fonts",
)
# /dev/shm: POSIX shared memory and semaphores (Python's multiprocessing) need it; memory, so small.
SHM_BYTES = 64 * MiB


def find_bwrap() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailableError(
            "bubblewrap (`bwrap`) is not installed, and agents and model-written code run in its sandbox: "
            "install it (Debian/Ubuntu: `sudo apt-get install bubblewrap`; Fedora/RHEL: `sudo dnf install "
            "bubblewrap`; the repository's `make test` runs scripts/ensure_bubblewrap.sh), or opt out "
            "with agent_sandbox='none' (docs/harness.md, 'The sandbox')"
        )
    return path


@dataclass(frozen=True)
class SandboxFolders:
    """The host folders of one sandbox: `work`, `home` and `tmp`, which it writes in, and `private`,
    which it never sees (the files its /etc gets)."""

    work: Path
    home: Path
    tmp: Path
    private: Path

    @classmethod
    def make(cls, root: Path) -> SandboxFolders:
        """The folders under `root` (a private folder of the caller's), made where missing."""
        folders = cls(root / "work", root / "home", root / "tmp", root / "sandbox")
        for folder in (folders.work, folders.home, folders.tmp, folders.private):
            folder.mkdir(exist_ok=True)
        return folders

    def writable(self) -> list[Path]:
        return [self.work, self.home, self.tmp]


PREFIXES = "import sys; print(sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, sep='\\n')"
# How long a Python other than the trainer's may take to say where it is installed.
PREFIX_QUERY_TIMEOUT_S = 60.0


@functools.lru_cache(maxsize=64)
def python_prefixes(executable: str) -> tuple[str, ...]:
    """Where a Python interpreter is installed (its standard library, a virtual environment's packages),
    as the interpreter itself says: the trainer's own from `sys`, another's by asking it (once). Empty
    for a program that is no Python."""
    if Path(executable).absolute() == Path(sys.executable).absolute():
        return (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)
    try:
        answer = subprocess.run(
            [executable, "-I", "-c", PREFIXES], capture_output=True, text=True, timeout=PREFIX_QUERY_TIMEOUT_S
        )
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(answer.stdout.split("\n")[:4]) if answer.returncode == 0 else ()


def interpreter_paths(executable: str) -> list[Path]:
    """What a program needs of its own install: the file and where its link leads, and for a Python
    interpreter its installation and virtual environment."""
    path = Path(executable).absolute()
    found = [path, path.resolve()]
    if "python" in path.name or "python" in path.resolve().name:
        found += [Path(prefix) for prefix in python_prefixes(str(path)) if prefix]
    return found


def program_paths(command: list[str], search_path: str | None) -> list[Path]:
    """The command's program (looked up on `search_path`) and its files (elements naming an
    existing file: the agent's script)."""
    program = shutil.which(command[0], path=search_path) or command[0]
    found = interpreter_paths(program) if os.path.isabs(program) else []
    for part in command[1:]:
        if os.path.isabs(part) and os.path.isfile(part):
            found += [Path(part), Path(part).resolve()]
    return found


def _refuse_home(path: Path) -> None:
    """A bind that would show the trainer user's whole home (its credentials, tokens, keys) is refused."""
    home = Path(os.path.expanduser("~")).resolve()
    if home == path.resolve() or path.resolve() in home.parents:
        raise SandboxError(
            f"the sandbox would show {path}, which holds the home folder {home} (its credentials and "
            "tokens): name a folder inside it in agent_readable_paths, or install the interpreter "
            "outside the home folder itself (docs/harness.md, 'The sandbox')"
        )


def _covered(path: Path, bound: list[Path]) -> bool:
    return any(path == root or root in path.parents for root in bound)


def read_only_binds(paths: list[Path]) -> list[str]:
    """`--ro-bind` arguments for `paths` that exist, each once, none under a path already bound or
    under the system paths (a link's target is bound at the link's place too: a virtual environment
    reached through a link works at either path)."""
    bound = [Path(p) for p in SYSTEM_PATHS]
    arguments: list[str] = []
    candidates = {Path(os.path.abspath(p)) for p in paths} | {Path(p).resolve() for p in paths}
    for path in sorted(candidates, key=lambda p: (len(p.parts), str(p))):
        if not path.exists() or _covered(path, bound) or path == Path("/"):
            continue
        _refuse_home(path)
        arguments += ["--ro-bind", str(path.resolve()), str(path)]
        bound.append(path)
    return arguments


def system_binds() -> list[str]:
    arguments: list[str] = []
    for name in SYSTEM_PATHS:
        if os.path.islink(name):
            arguments += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            arguments += ["--ro-bind", name, name]
    for entry in ETC_ENTRIES:
        path = os.path.join("/etc", entry)
        if os.path.islink(path):
            arguments += ["--symlink", os.readlink(path), path]
        elif os.path.exists(path):
            arguments += ["--ro-bind", path, path]
    return arguments


def identity_files(private: Path) -> list[str]:
    """The sandbox's own /etc/passwd, /etc/group, /etc/hosts and /etc/hostname (written to `private`):
    programs that look up their user or `localhost` find them."""
    files = {
        "passwd": f"{SANDBOX_USER}:x:{SANDBOX_UID}:{SANDBOX_GID}::{HOME}:/bin/sh\n"
        "nobody:x:65534:65534::/nonexistent:/usr/sbin/nologin\n",
        "group": f"{SANDBOX_USER}:x:{SANDBOX_GID}:\nnogroup:x:65534:\n",
        "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
        "hostname": "sandbox\n",
    }
    arguments: list[str] = []
    for name, text in files.items():
        (private / name).write_text(text)
        arguments += ["--ro-bind", str(private / name), f"/etc/{name}"]
    return arguments


def bwrap_command(
    folders: SandboxFolders,
    command: list[str],
    limits: SandboxLimits,
    *,
    search_path: str | None = None,
    readable_paths: list[str] | tuple[str, ...] = (),
    writable_paths: list[str] | tuple[str, ...] = (),
    proxy_socket: str | None = None,
    bwrap_options: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """The argv that runs `command` in a sandbox (the module's docstring says what it sees), under
    `limits`, in `folders`. `search_path`: the PATH `command[0]` is looked up on (the command's own).
    `proxy_socket`: the capture proxy's Unix socket, bridged to 127.0.0.1:PROXY_PORT inside.
    `bwrap_options`: more of bubblewrap's options. The environment is the caller's to give the returned
    command (a command line is readable by every user of the machine; an environment is not)."""
    launcher_settings = {"limits": {k: v for k, v in asdict(limits).items() if k != "disk_bytes"}}
    arguments = [
        find_bwrap(),
        *bwrap_options,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_GID),
        "--hostname",
        "sandbox",
        # Its own folders first: a path bound later beneath one of them (a readable path under /tmp)
        # stays visible.
        "--bind",
        str(folders.tmp),
        TMP,
        "--bind",
        str(folders.home),
        HOME,
        "--bind",
        str(folders.work),
        WORK,
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(SHM_BYTES),
        "--tmpfs",
        "/dev/shm",
        "--remount-ro",
        "/dev",
        *system_binds(),
        *identity_files(folders.private),
        *read_only_binds(
            interpreter_paths(sys.executable)
            + program_paths(command, search_path)
            + [Path(p) for p in readable_paths]
        ),
    ]
    for path in writable_paths:
        _refuse_home(Path(path))
        arguments += ["--bind", str(Path(path).resolve()), str(Path(path).absolute())]
    if proxy_socket is not None:
        arguments += ["--bind", proxy_socket, PROXY_SOCKET]
        launcher_settings["proxy"] = {"socket": PROXY_SOCKET, "port": PROXY_PORT}
    arguments += ["--ro-bind", str(INSIDE), LAUNCHER, "--remount-ro", "/", "--chdir", WORK]
    launcher = [sys.executable, "-I", "-S", LAUNCHER, json.dumps(launcher_settings), "--"]
    return [*arguments, "--", *launcher, *command]


class SandboxCommand:
    """A sandbox's command line (`argv`, bwrap_command's arguments) and, for a trainer running as root,
    the cgroup that bounds its processes (asyncgrpo/sandbox/cgroup.py): `release()` it once the
    sandbox has ended and its processes are reaped."""

    def __init__(self, folders: SandboxFolders, command: list[str], limits: SandboxLimits, **options):
        self.folders = folders
        argv = bwrap_command(folders, command, limits, **options)
        self.cgroup = SandboxCgroup(limits.processes) if needs_cgroup() else None
        self.argv = self.cgroup.enter(argv) if self.cgroup is not None else argv

    def release(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()
