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
- every TCP port listening in the network it is in (/proc/net/tcp and tcp6: the kernel shows a process
  the sockets of its own network namespace, so a sandbox sharing the machine's would list the
  machine's), each connected to on the loopback. Not a scan of all 65,535 ports: that took up to 25 s
  on a loaded machine, longer than the other agents' whole runs, and reaches no port the table leaves out.
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


LISTENING = "0A"  # the TCP state column of /proc/net/tcp: LISTEN


def listening_ports(table: str) -> set[int]:
    """The ports of the sockets that listen, from /proc/net/tcp or tcp6 (local address as HEX:PORT)."""
    try:
        lines = pathlib.Path(table).read_text().splitlines()[1:]
    except OSError:
        return set()
    rows = [line.split() for line in lines]
    return {int(row[1].rsplit(":", 1)[1], 16) for row in rows if row[3] == LISTENING}


def ports(found: dict) -> None:
    for family, address, table in (
        (socket.AF_INET, "127.0.0.1", "/proc/net/tcp"),
        (socket.AF_INET6, "::1", "/proc/net/tcp6"),
    ):
        for port in sorted(listening_ports(table)):
            with socket.socket(family) as sock:
                sock.settimeout(1.0)
                try:
                    sock.connect((address, port))
                except OSError:
                    continue
                if port not in found["ports"]:
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
