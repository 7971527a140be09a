"""The sandbox's errors: what a user catches when a sandbox cannot be used at all. Code that fails
inside a sandbox is no error of these: `run()` returns its result (docs/harness.md, "The sandbox")."""

from __future__ import annotations


class SandboxError(RuntimeError):
    """A sandbox could not be set up or run (the message says what to change)."""


class SandboxUnavailableError(SandboxError):
    """This machine cannot start the sandbox: bubblewrap is missing, or the kernel refuses the user
    namespace it needs. The message names what to install or set."""
