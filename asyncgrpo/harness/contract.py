"""OpenEnv's harness contract (openenv 0.10, `openenv.core.harness`) in our own types, field for
field, so that the harness needs no OpenEnv installed.

Why not OpenEnv's own classes: importing any `openenv.core` module imports its environment server,
which imports fastmcp, and every fastmcp release OpenEnv accepts needs mcp < 2, while vLLM needs
mcp >= 2; the two cannot share one environment. Everything the trainer does with a session,
adapter or trace is attribute access and method calls, so OpenEnv's objects and these are used
alike: a user's OpenEnv `ResourceSessionFactory`, `HarnessAdapter` or `TrainingTrace` works
unchanged, and OpenEnv's adapters read the `ModelStepResult` and `HarnessRunLimits` the trainer
passes them as they read their own (tests/unit/test_openenv_conformance.py checks both ways against
OpenEnv). Loop-owning sessions, the trainer's half of white-box sampling and the local-process
harness use these types; a user writing a session or adapter without OpenEnv can too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

# -- sessions: tools and scoring ---------------------------------------------------------------------


@dataclass
class Tool:
    """A tool a session offers (the MCP tool spec): what `list_tools()` returns."""

    name: str
    description: str
    input_schema: dict[str, Any]


@dataclass
class ToolResult:
    """What a session's `call_tool()` returns; `error` set means the call failed."""

    data: Any = None
    done: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class VerifyResult:
    """What a session's `verify()` returns: `env_reward` None leaves the rollout unscored."""

    env_reward: float | None = None
    done: bool = False
    metrics: dict[str, Any] = field(default_factory=dict)
    artifacts: dict[str, Any] = field(default_factory=dict)


# -- white-box: the adapter drives, the trainer samples --------------------------------------------------


@dataclass
class ToolCall:
    id: str
    name: str
    args: dict[str, Any]


@dataclass
class LLMResponse:
    """One sampled turn as an adapter reads it: its text and its parsed tool calls."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)

    def to_message_dict(self) -> dict[str, Any]:
        """The turn as an OpenAI assistant message (arguments as JSON text)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.args)},
                }
                for call in self.tool_calls
            ]
        return message


@dataclass
class ModelStepResult:
    """What the trainer's `model_step(messages, tools, sampling)` returns to the adapter."""

    response: LLMResponse
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class HarnessRunLimits:
    """The limits the trainer gives the adapter's `run_white_box()`."""

    max_turns: int = 10
    max_tool_calls_per_turn: int | None = None
    max_total_tool_calls: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)


@dataclass
class ToolTraceEntry:
    """One tool call an adapter made on the session, with its result."""

    tool_name: str
    arguments: dict[str, Any]
    result: ToolResult


@dataclass
class HarnessRolloutResult:
    """What an adapter's `run_white_box()` returns: the trainer reads `messages` and `tool_trace`."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    tool_trace: list[ToolTraceEntry] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    done: bool = False
    metrics: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


# -- loop-owning: the captured turns ---------------------------------------------------------------------


def check_training_turn(
    prompt_ids: list[int], completion_ids: list[int], logprobs: list[float], loss_mask: list[int]
) -> None:
    """ValueError unless the turn can be trained on: OpenEnv's fatal checks of a captured turn
    (non-negative integer ids, one finite, non-positive log-prob per completion id, a 0/1 mask over
    prompt and completion that trains no prompt position, some prompt ids)."""
    problems = []
    for name, ids in (("prompt", prompt_ids), ("completion", completion_ids)):
        if any(type(token) is not int or token < 0 for token in ids):
            problems.append(f"{name} ids must be non-negative integers")
    if any(
        isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp) for lp in logprobs
    ):
        problems.append("log-probs must be finite numbers")
    elif any(lp > 0 for lp in logprobs):
        problems.append("log-probs must not be positive")
    if not prompt_ids:
        problems.append("no prompt ids (the engine's own tokenization of the prompt is required)")
    if len(logprobs) != len(completion_ids):
        problems.append(f"{len(logprobs)} log-probs for {len(completion_ids)} completion ids")
    if len(loss_mask) != len(prompt_ids) + len(completion_ids):
        problems.append("loss_mask must cover prompt plus completion")
    elif any(type(flag) is not int or flag not in (0, 1) for flag in loss_mask):
        problems.append("loss_mask must hold only the integers 0 and 1")
    elif any(loss_mask[: len(prompt_ids)]):
        problems.append("prompt positions must not be trained")
    if problems:
        raise ValueError("invalid training turn: " + "; ".join(problems))


@dataclass
class TrainingTurn:
    """One model call as the engine saw it; checked when built (`check_training_turn`)."""

    node_id: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    per_token_logps: list[float]
    loss_mask: list[int]
    request: dict[str, Any] = field(default_factory=dict)
    response: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not self.node_id:
            raise ValueError("invalid training turn: node_id must not be empty")
        check_training_turn(
            self.prompt_token_ids, self.completion_token_ids, self.per_token_logps, self.loss_mask
        )


@dataclass
class TrainingTrace:
    """A session's captured turns, in order: what `fetch_training_trace()` returns."""

    turns: list[TrainingTurn]
    schema_version: int = 1

    def __post_init__(self):
        ids = [turn.node_id for turn in self.turns]
        if len(set(ids)) != len(ids):
            raise ValueError("training trace contains duplicate node_ids")

    def to_trace_entries(self) -> list[dict[str, Any]]:
        """The turns as trace entries (the dicts a `rollout_reward_fn` reads): every field but
        `node_id`, which moves into `metadata`."""
        return [
            {
                "prompt_token_ids": list(turn.prompt_token_ids),
                "completion_token_ids": list(turn.completion_token_ids),
                "per_token_logps": list(turn.per_token_logps),
                "loss_mask": list(turn.loss_mask),
                "request": turn.request,
                "response": turn.response,
                "metadata": {**turn.metadata, "node_id": turn.node_id},
            }
            for turn in self.turns
        ]
