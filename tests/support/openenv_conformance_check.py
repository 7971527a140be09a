"""asyncgrpo.harness's types against OpenEnv's own (tests/unit/test_openenv_conformance.py runs this in a
process that can import OpenEnv): the same fields and defaults, OpenEnv's adapter driven by the
trainer's model step, OpenEnv's traces read by the trainer and the trainer's by OpenEnv, the same
turns refused, and the local-process session offering every method of OpenEnv's session interfaces.
Prints "conformant" when every check holds."""

from __future__ import annotations

import dataclasses
import inspect
import math

import openenv.core.harness as openenv_harness
import openenv.core.llm_client as openenv_llm
from openenv.core.env_server.mcp_types import Tool as OpenEnvTool
from openenv.core.harness.capture.validate import validate_training_turn

from asyncgrpo import harness as ours
from asyncgrpo.harness.contract import check_training_turn
from asyncgrpo.harness.trace import training_turn, turns_from_trace
from asyncgrpo.harness.white_box import tool_schemas
from asyncgrpo.rollout.types import TurnRecord

DATACLASSES = [
    (ours.ToolResult, openenv_harness.ToolResult),
    (ours.VerifyResult, openenv_harness.VerifyResult),
    (ours.ToolTraceEntry, openenv_harness.ToolTraceEntry),
    (ours.HarnessRolloutResult, openenv_harness.HarnessRolloutResult),
    (ours.HarnessRunLimits, openenv_harness.HarnessRunLimits),
    (ours.ModelStepResult, openenv_harness.ModelStepResult),
    (ours.LLMResponse, openenv_llm.LLMResponse),
    (ours.ToolCall, openenv_llm.ToolCall),
]
MODELS = [
    (ours.Tool, OpenEnvTool),
    (ours.TrainingTurn, openenv_harness.TrainingTurn),
    (ours.TrainingTrace, openenv_harness.TrainingTrace),
]


def dataclass_fields(cls) -> list[tuple[str, object]]:
    """(name, default) in order; a default factory's value stands for its default."""
    return [
        (f.name, f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
        for f in dataclasses.fields(cls)
    ]


def model_fields(cls) -> dict[str, object]:
    """A pydantic model's fields as {name: default} (MISSING when required)."""
    return {
        name: dataclasses.MISSING if info.is_required() else info.get_default(call_default_factory=True)
        for name, info in cls.model_fields.items()
    }


def check_fields() -> None:
    for mine, theirs in DATACLASSES:
        assert dataclass_fields(mine) == dataclass_fields(theirs), (mine, theirs)
    for mine, theirs in MODELS:
        assert dict(dataclass_fields(mine)) == model_fields(theirs), (mine, theirs)


class NoteSession(openenv_harness.ResourceSession):
    """An OpenEnv session with one tool, for OpenEnv's own white-box adapter."""

    def __init__(self):
        self.notes = []

    def initial_messages(self):
        return [{"role": "user", "content": "Keep a note."}]

    def list_tools(self):
        return [OpenEnvTool(name="note", description="Keep a note.", input_schema={"type": "object"})]

    def call_tool(self, name, arguments):
        self.notes.append(arguments)
        return openenv_harness.ToolResult(data="kept")

    def verify(self, transcript, final_state=None):
        return openenv_harness.VerifyResult(env_reward=float(len(self.notes)))

    def close(self):
        pass


def scripted_model_step(types):
    """A model step built from `types` (ours or OpenEnv's): a call of the session's tool, then a reply."""
    replies = [
        types.LLMResponse(content="", tool_calls=[types.ToolCall(id="c0", name="note", args={"text": "hi"})]),
        types.LLMResponse(content="Done."),
    ]

    def model_step(messages, tools, sampling):
        assert tool_schemas(tools)[0]["function"]["name"] == "note"  # the trainer reads OpenEnv's tools
        return types.ModelStepResult(
            response=replies.pop(0), prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.5]
        )

    return model_step


class OpenEnvTypes:
    LLMResponse, ToolCall, ModelStepResult = (
        openenv_llm.LLMResponse,
        openenv_llm.ToolCall,
        openenv_harness.ModelStepResult,
    )


def check_white_box() -> None:
    """OpenEnv's MCP adapter does the same with the trainer's model step and limits as with its own."""
    adapter = openenv_harness.MCPHarnessAdapter()
    runs = []
    for types, limits in [(ours, ours.HarnessRunLimits(max_turns=4)), (OpenEnvTypes, None)]:
        session = NoteSession()
        limits = limits or openenv_harness.HarnessRunLimits(max_turns=4)
        result = adapter.run_white_box(scripted_model_step(types), session, limits)
        runs.append((result.messages, [(e.tool_name, e.arguments) for e in result.tool_trace], session.notes))
    assert runs[0] == runs[1] and runs[0][1] == [("note", {"text": "hi"})], runs
    message = ours.LLMResponse("x", [ours.ToolCall("c", "f", {"a": 1})]).to_message_dict()
    assert (
        message == openenv_llm.LLMResponse("x", [openenv_llm.ToolCall("c", "f", {"a": 1})]).to_message_dict()
    )


def check_traces() -> None:
    """The trainer's trace and OpenEnv's read alike, both ways."""
    first = TurnRecord([1, 2, 3], [10, 11], [-0.5, -0.25], finish_reason="stop", model_version=3)
    second = TurnRecord([1, 2, 3, 10, 11, 4], [12], [-1.0], finish_reason="stop", model_version=4)
    turns = [
        training_turn(turn, f"e-{i}", {"messages": []}, {"choices": []})
        for i, turn in enumerate([first, second])
    ]
    mine = ours.TrainingTrace(turns=turns)
    theirs = openenv_harness.TrainingTrace(
        turns=[openenv_harness.TrainingTurn(**dataclasses.asdict(turn)) for turn in turns]
    )
    assert mine.to_trace_entries() == theirs.to_trace_entries()
    from_entries = openenv_harness.TrainingTrace.from_entries
    assert from_entries(mine.to_trace_entries()) == from_entries(theirs.to_trace_entries())
    assert turns_from_trace(theirs, 0, top_n=0) == turns_from_trace(mine, 0, top_n=0)


# (prompt ids, completion ids, log-probs, loss mask): turns OpenEnv accepts or refuses, each for a reason.
TURNS = [
    ([1, 2], [3, 4], [-0.1, -0.2], [0, 0, 1, 1]),  # fine
    ([1, 2], [], [], [0, 0]),  # nothing sampled: accepted (a warning in OpenEnv's report)
    ([1, 2], [3, 4], [-0.1], [0, 0, 1, 1]),  # log-probs misaligned
    ([], [3], [-0.1], [1]),  # no prompt ids
    ([1], [3], [0.5], [0, 1]),  # a positive log-prob
    ([1], [3], [math.nan], [0, 1]),  # a non-finite log-prob
    ([1], [3], [True], [0, 1]),  # a bool for a log-prob
    ([-1], [3], [-0.1], [0, 1]),  # a negative id
    ([True], [3], [-0.1], [0, 1]),  # a bool for an id
    ([1], [3], [-0.1], [0]),  # a mask too short
    ([1], [3], [-0.1], [1, 1]),  # a trained prompt position
    ([1], [3], [-0.1], [0, 2]),  # a mask value other than 0 or 1
]


def refuses(check, turn) -> bool:
    try:
        check(*turn)
    except ValueError:
        return True
    return False


def check_refusals() -> None:
    verdicts = [(refuses(check_training_turn, t), refuses(validate_training_turn, t)) for t in TURNS]
    assert all(mine == theirs for mine, theirs in verdicts), list(zip(TURNS, verdicts))
    assert [theirs for _, theirs in verdicts] == [False, False] + [True] * (len(TURNS) - 2)


def check_process_session() -> None:
    """ProcessSession and its factory offer every method of OpenEnv's session interfaces, with the
    same parameters."""
    required = [
        (
            ours.ProcessSession,
            openenv_harness.ResourceSession,
            sorted(openenv_harness.ResourceSession.__abstractmethods__),
        ),
        (
            ours.ProcessSession,
            openenv_harness.TrainableSession,
            ["wait_for_completion", "fetch_training_trace"],
        ),
        (ours.ProcessSessionFactory, openenv_harness.ResourceSessionFactory, ["create"]),
    ]
    for mine, theirs, methods in required:
        for name in methods:
            expected = list(inspect.signature(getattr(theirs, name)).parameters)
            assert list(inspect.signature(getattr(mine, name)).parameters) == expected, (mine, name)


if __name__ == "__main__":
    check_fields()
    check_white_box()
    check_traces()
    check_refusals()
    check_process_session()
    print("conformant")
