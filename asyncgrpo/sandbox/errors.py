"""The sandbox's errors: what a user catches when a sandbox cannot be used at all. Code that fails
inside a sandbox is no error of these: `run()` returns its result (docs/harness.md, "The sandbox").
`SandboxError` is the library's sandbox branch (asyncgrpo/errors.py); this module adds the one case a
caller tells apart."""

from __future__ import annotations

from asyncgrpo.errors import SandboxError


class SandboxUnavailableError(SandboxError):
    """This machine cannot start the sandbox: bubblewrap is missing, or the kernel refuses the user
    namespace it needs. The message names what to install or set."""


__all__ = ["SandboxError", "SandboxUnavailableError"]
