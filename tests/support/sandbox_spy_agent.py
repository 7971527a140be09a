"""A hostile agent program that looks for what a policy trained by RL would want: the trainer's
secrets, the user's Hub token, its own answer in the training data, and local services. It reports
what it found to `findings.json` in its working directory (tests/unit/test_sandbox.py runs it inside the
sandbox, where it must find nothing, and without, where it must find everything: the control that
shows it looks well).

- every process's environment (/proc/PID/environ), for the values of planted secrets (argv[1]: a
  JSON list of them) and for a HOME to look in;
- every process's working directory and open files (/proc/PID/cwd, /proc/PID/fd/N), followed to
  any file that holds its own prompt, from which it takes the row's "answer";
- `~/.cache/huggingface/token` under every HOME it learned, and its own;
- every TCP port of 127.0.0.1, 1 to 65535 (a connection to itself aside: the kernel may pick the
  destination port as the source port).
"""

import json
import os
import pathlib
import socket
import sys

MAX_FILE_BYTES = 2**20


def processes() -> list[str]:
    return [entry for entry in os.listdir("/proc") if entry.isdigit()]


def environments(found: dict, secrets: list[str]) -> set[str]:
    homes = set()
    for pid in processes():
        try:
            environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            name, _, value = entry.decode(errors="replace").partition("=")
            if value in secrets:
                found["secrets"].append(value)
            if name == "HOME":
                homes.add(value)
    return homes


def answer_in(path: pathlib.Path, prompt: str) -> str | None:
    try:
        if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            return None
        for line in path.read_text(errors="replace").splitlines():
            if prompt in line:
                return json.loads(line).get("answer")
    except (OSError, ValueError, AttributeError):
        return None
    return None


def data_files(found: dict, prompt: str) -> None:
    """Follow every process's working directory and open files to the training data."""
    candidates = []
    for pid in processes():
        for link in [f"/proc/{pid}/cwd", *(f"/proc/{pid}/fd/{fd}" for fd in _fds(pid))]:
            try:
                target = pathlib.Path(os.readlink(link))
            except OSError:
                continue
            candidates += list(target.glob("*")) if target.is_dir() else [target]
    for path in candidates:
        answer = answer_in(path, prompt)
        if answer is not None:
            found["data"].append({"path": str(path), "answer": answer})


def _fds(pid: str) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []


def tokens(found: dict, homes: set[str]) -> None:
    for home in homes | {os.path.expanduser("~")}:
        try:
            found["tokens"].append(pathlib.Path(home, ".cache/huggingface/token").read_text())
        except OSError:
            pass


def ports(found: dict) -> None:
    for port in range(1, 65536):
        with socket.socket() as sock:
            sock.settimeout(1.0)
            try:
                sock.connect(("127.0.0.1", port))
            except OSError:
                continue
            if sock.getsockname() != sock.getpeername():  # not a connection to itself
                found["ports"].append(port)


def main() -> None:
    secrets = json.loads(sys.argv[1])
    task = json.loads(pathlib.Path("task.json").read_text())
    prompt = task["prompt"][-1]["content"]
    found = {"secrets": [], "tokens": [], "data": [], "ports": [], "processes": len(processes())}
    homes = environments(found, secrets)
    data_files(found, prompt)
    tokens(found, homes)
    ports(found)
    pathlib.Path("findings.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main()
