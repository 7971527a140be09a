"""Training agent programs that own their loop (docs/harness.md): a session per rollout from an
OpenEnv `ResourceSessionFactory`, the agent's model calls captured on the token route, the turns
chained into samples, the reward from the session's `verify()`.

Needs the `harness` extra (`pip install 'asyncgrpo[harness]'`): OpenEnv's session and trace types.
"""

from __future__ import annotations

try:
    import openenv.core.harness  # noqa: F401  (checked here, so the message names the extra)
except ImportError as error:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"asyncgrpo.harness needs OpenEnv ({error}): install it with pip install 'asyncgrpo[harness]'"
    ) from error

from asyncgrpo.harness.loop import HarnessRolloutOutcome
from asyncgrpo.harness.process_session import ProcessSession, ProcessSessionFactory
from asyncgrpo.harness.trace import CaptureContractError

__all__ = ["CaptureContractError", "HarnessRolloutOutcome", "ProcessSession", "ProcessSessionFactory"]
