"""What one sandbox may use, and the defaults for an agent and for a piece of model-written code.

Each per-process bound is a kernel resource limit (`setrlimit`), which needs no privilege and no
cgroup: it works for an unprivileged user on a cluster node as for root in a container. The sandbox
sets them in its first process, inside its own user namespace, just before it starts the command,
as hard limits the command cannot raise. `processes` is RLIMIT_NPROC, which the kernel counts per
user of a user namespace (Linux 5.14 and later): every sandbox has its own, so the bound is on the
sandbox's processes and threads alone, not on everything its user runs on the machine. `disk_bytes`
is no kernel limit: the sandbox's writable folders are measured from outside every
`WATCH_INTERVAL_S`, and a sandbox past the bound is ended (docs/harness.md, "The sandbox", says
what that bounds and what it does not).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from asyncgrpo.errors import ConfigurationError

GiB, MiB = 2**30, 2**20
# How often the writable folders of a running sandbox are measured against disk_bytes: a writer at
# the page cache's speed passes the bound by what it writes in this time before it is ended (measured:
# docs/harness.md, "The sandbox"); each of its files stays under file_bytes.
WATCH_INTERVAL_S = 0.1


@dataclass(frozen=True)
class SandboxLimits:
    """Bounds on what a sandbox may use. Per process: `memory_bytes` (address space: an allocation
    past it fails), `cpu_seconds` (CPU time: SIGXCPU, then SIGKILL a few seconds later),
    `file_bytes` (the largest file it may write: a write past it fails with EFBIG), `open_files`.
    For the whole sandbox: `processes` (processes and threads alive at once: a fork past it fails
    with EAGAIN) and `disk_bytes` (all it writes in its folders: past it, the sandbox is ended)."""

    memory_bytes: int = 4 * GiB
    processes: int = 256
    cpu_seconds: int = 3600
    file_bytes: int = 1 * GiB
    disk_bytes: int = 4 * GiB
    open_files: int = 1024

    def __post_init__(self):
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"SandboxLimits.{name}={value!r} must be a positive whole number")
        if self.processes < 2:
            raise ConfigurationError(
                f"SandboxLimits.processes={self.processes} must be >= 2: the sandbox's own first process "
                "counts, beside the command"
            )


# An agent: an interpreter with an HTTP client and whatever tools it runs (a compiler, a test suite),
# for up to an hour of CPU; bounded so that a runaway agent cannot take the machine's memory or disk.
AGENT_LIMITS = SandboxLimits()
# A piece of model-written code under test: small programs, seconds of CPU.
CODE_LIMITS = SandboxLimits(
    memory_bytes=1 * GiB, processes=32, cpu_seconds=60, file_bytes=64 * MiB, disk_bytes=256 * MiB
)
