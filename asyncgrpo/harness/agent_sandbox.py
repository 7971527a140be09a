"""The sandbox an agent of `ProcessSessionFactory` runs in (docs/harness.md, "The sandbox"): the
factory's `agent_sandbox`, `agent_limits`, `agent_readable_paths` and `agent_writable_paths`, checked
when the factory is made (and by the trainer when it is built, before any rollout), and what a
session needs of them: the command line, the agent's view of its folders and of the capture proxy.

Safe by default: every agent is sandboxed unless the user opts out by name, `agent_sandbox="none"`,
which is warned about once per process.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.sandbox import AGENT_LIMITS, SandboxLimits, check_available
from asyncgrpo.sandbox.bubblewrap import HOME, PROXY_PORT, TMP, WORK, SandboxCommand, SandboxFolders

logger = logging.getLogger(__name__)

SANDBOXED, UNSANDBOXED = "bubblewrap", "none"
_warned_unsandboxed = False
_warn_lock = threading.Lock()


@dataclass(frozen=True)
class AgentSandbox:
    """What an agent's sandbox allows beyond the defaults: `limits`, host paths it may read, host
    paths it may write (shared by every agent: a place to leave results, never the run's data)."""

    limits: SandboxLimits = AGENT_LIMITS
    readable_paths: tuple[str, ...] = ()
    writable_paths: tuple[str, ...] = ()

    # The agent's view of its session, inside the sandbox.
    workdir = WORK
    home = HOME
    temp_dir = TMP
    base_url = f"http://127.0.0.1:{PROXY_PORT}/v1"

    def command(
        self, root: Path, command: list[str], search_path: str | None, proxy_socket: str | None
    ) -> SandboxCommand:
        """The sandboxed command of a session whose private folder is `root` (the agent writes in its
        work/, home/ and tmp/ folders, and sees nothing else of it)."""
        return SandboxCommand(
            SandboxFolders.make(root),
            command,
            self.limits,
            search_path=search_path,
            readable_paths=self.readable_paths,
            writable_paths=self.writable_paths,
            proxy_socket=proxy_socket,
        )


def agent_sandbox(
    choice: str,
    limits: SandboxLimits | None,
    readable_paths: Sequence[str] | None,
    writable_paths: Sequence[str] | None,
) -> AgentSandbox | None:
    """The sandbox the factory's options ask for (None: `agent_sandbox="none"`), checked."""
    if choice not in (SANDBOXED, UNSANDBOXED):
        raise ConfigurationError(
            f"agent_sandbox={choice!r}: use {SANDBOXED!r} (the default: every agent in a sandbox) or "
            f"{UNSANDBOXED!r} (agents run as the trainer's user, with its view of the machine)"
        )
    paths = {"agent_readable_paths": readable_paths, "agent_writable_paths": writable_paths}
    for name, value in paths.items():
        if isinstance(value, str) or not all(isinstance(path, str) for path in value or ()):
            raise ConfigurationError(f"{name} must be a list of paths, got {value!r}")
        missing = [path for path in value or () if not os.path.exists(path)]
        if missing:
            raise ConfigurationError(f"{name} names {missing}, which do not exist on this machine")
    if choice == UNSANDBOXED:
        given = [name for name, value in {"agent_limits": limits, **paths}.items() if value]
        if given:
            raise ConfigurationError(
                f"{', '.join(given)} bound the agent's sandbox, which agent_sandbox='none' turns off: "
                "remove them, or keep the sandbox"
            )
        return None
    if limits is not None and not isinstance(limits, SandboxLimits):
        raise ConfigurationError(f"agent_limits must be an asyncgrpo.sandbox.SandboxLimits, got {limits!r}")
    return AgentSandbox(limits or AGENT_LIMITS, tuple(readable_paths or ()), tuple(writable_paths or ()))


def check_factory_before_rollouts(factory: Any) -> None:
    """The factory's own check, before any rollout: `check_before_rollouts(**options)` of the class a
    (nested) `functools.partial` wraps, given the partial's keyword options (ProcessSessionFactory's:
    the sandbox starts on this machine, or the opt-out's warning)."""
    options: dict[str, Any] = {}
    while isinstance(factory, functools.partial):
        options = {**factory.keywords, **options}
        factory = factory.func
    check = getattr(factory, "check_before_rollouts", None)
    if callable(check):
        check(**options)


def ready(sandbox: AgentSandbox | None) -> None:
    """Before any agent runs: a sandbox this machine can start (SandboxUnavailableError says what to
    install or set), or the opt-out's warning, once per process."""
    global _warned_unsandboxed
    if sandbox is not None:
        check_available()
        return
    with _warn_lock:
        if _warned_unsandboxed:
            return
        _warned_unsandboxed = True
    logger.warning(
        "agent_sandbox='none': agents run without a sandbox, as the trainer's user, with its view of the "
        "machine: they can read its files (the training data, ~/.cache/huggingface/token, SSH keys), "
        "every process's environment under /proc, and reach every local service and the network "
        "(docs/harness.md, 'What an agent can and cannot do')"
    )
