"""Training agent programs that own their loop (docs/harness.md): a session per rollout from an
OpenEnv-style `ResourceSessionFactory`, the agent's model calls captured on the token route, the
turns chained into samples, the reward from the session's `verify()`.

Needs nothing beyond asyncgrpo's own dependencies: OpenEnv's harness types are mirrored in
harness/contract.py (OpenEnv cannot share an environment with vLLM: it says why), and OpenEnv's own
factories, sessions and adapters work with them unchanged.
"""

from __future__ import annotations

from asyncgrpo.harness.contract import (
    HarnessRolloutResult,
    HarnessRunLimits,
    LLMResponse,
    ModelStepResult,
    Tool,
    ToolCall,
    ToolResult,
    ToolTraceEntry,
    TrainingTrace,
    TrainingTurn,
    VerifyResult,
)
from asyncgrpo.harness.loop import HarnessRolloutOutcome
from asyncgrpo.harness.process_session import ProcessSession, ProcessSessionFactory
from asyncgrpo.harness.trace import CaptureContractError

__all__ = [
    "CaptureContractError",
    "HarnessRolloutOutcome",
    "HarnessRolloutResult",
    "HarnessRunLimits",
    "LLMResponse",
    "ModelStepResult",
    "ProcessSession",
    "ProcessSessionFactory",
    "Tool",
    "ToolCall",
    "ToolResult",
    "ToolTraceEntry",
    "TrainingTrace",
    "TrainingTurn",
    "VerifyResult",
]
