"""The sandbox of agents and model-written code (docs/harness.md, "The sandbox"): bubblewrap with
new user, PID, mount, IPC and network namespaces, the system's programs read-only, a working folder
of its own, no network but the capture proxy when bridged in, and resource limits.

`ProcessSessionFactory` runs every agent in it (asyncgrpo/harness/process_session.py); tools and
reward functions call `run()` for code the model wrote (asyncgrpo.rewards.code_execution_reward
does); `check_available()` says at once whether this machine can start one.
"""

from asyncgrpo.sandbox.check import check_available
from asyncgrpo.sandbox.errors import SandboxError, SandboxUnavailableError
from asyncgrpo.sandbox.limits import AGENT_LIMITS, CODE_LIMITS, SandboxLimits
from asyncgrpo.sandbox.runner import SandboxResult, run

__all__ = [
    "AGENT_LIMITS",
    "CODE_LIMITS",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailableError",
    "check_available",
    "run",
]
