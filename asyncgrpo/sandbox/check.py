"""Whether this machine can start the sandbox, asked once per process before any agent or
model-written code runs: the trainer asks when it is built, so a machine without bubblewrap or
without user namespaces stops the run before its first rollout, with what to install or set.

The probe is a real sandbox (the same command line as every other, a Python that does nothing):
what it proves is what every run needs.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from asyncgrpo.sandbox.errors import SandboxUnavailableError
from asyncgrpo.sandbox.limits import CODE_LIMITS
from asyncgrpo.sandbox.runner import run

# A probe that fails takes no longer than this: a start on a loaded machine takes a second at most.
PROBE_TIMEOUT_S = 60.0
_checked = False
_check_lock = threading.Lock()

# The kernel settings that refuse the user namespace bubblewrap makes, and how to allow it.
USERNS_SETTINGS = (
    ("/proc/sys/user/max_user_namespaces", "0", "sudo sysctl -w user.max_user_namespaces=15000"),
    ("/proc/sys/kernel/unprivileged_userns_clone", "0", "sudo sysctl -w kernel.unprivileged_userns_clone=1"),
    (
        "/proc/sys/kernel/apparmor_restrict_unprivileged_userns",
        "1",
        "an AppArmor profile that gives /usr/bin/bwrap the `userns` permission (Ubuntu 24.04 and later), "
        "or sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0",
    ),
)


def check_available() -> None:
    """Return when a sandbox starts on this machine (checked once per process); else raise
    SandboxUnavailableError naming what to install or set."""
    global _checked
    with _check_lock:
        if _checked:
            return
        result = run(
            [sys.executable, "-I", "-S", "-c", "pass"], timeout_s=PROBE_TIMEOUT_S, limits=CODE_LIMITS
        )
        if not result.ok:
            raise SandboxUnavailableError(_diagnosis(result.stderr.strip(), result.timed_out))
        _checked = True


def _diagnosis(stderr: str, timed_out: bool) -> str:
    if timed_out:
        said = f"did not start within {PROBE_TIMEOUT_S:g} s"
    else:
        said = f"failed: {stderr or 'no message'}"
    causes = [fix for path, refused, fix in USERNS_SETTINGS if _read(path) == refused]
    if causes:
        how = "this kernel refuses unprivileged user namespaces; allow them: " + "; ".join(causes)
    else:
        how = (
            "bubblewrap needs user namespaces (in a container, the container's seccomp and AppArmor "
            "profiles must allow them: Docker's `--security-opt seccomp=unconfined --security-opt "
            "apparmor=unconfined`, or a rootless Podman)"
        )
    return (
        f"the agent sandbox (bubblewrap) {said}. {how}. Inside a container that already isolates the "
        "run from everything you care about, agent_sandbox='none' opts out (docs/harness.md, 'The sandbox')"
    )


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None
