"""White-box sampling: the `model_step` an OpenEnv `HarnessAdapter` calls for each turn, sampled by
the trainer itself. The adapter drives the session (its tools, its stop rule) from a session thread;
each turn is rendered by the chat template, sampled on the worker's event loop through
`generate_one_turn`, recorded as a TurnRecord, and read back into the `LLMResponse` (OpenEnv's type,
harness/contract.py) the adapter reads.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from asyncgrpo.harness.contract import LLMResponse, ModelStepResult, ToolCall
from asyncgrpo.harness.openai_chat import parse_sampled_turn, template_messages
from asyncgrpo.rollout.chat import render_prompt_ids
from asyncgrpo.rollout.types import TurnRecord

if TYPE_CHECKING:
    from asyncgrpo.rollout.loop import AsyncRolloutLoop


def tool_schemas(tools: list) -> list[dict[str, Any]]:
    """MCP tools (`Tool`s: name, description, input schema) as the function schemas chat templates
    read."""
    return [
        {
            "type": "function",
            "function": {"name": tool.name, "description": tool.description, "parameters": tool.input_schema},
        }
        for tool in tools
    ]


class WhiteBoxSampler:
    """OpenEnv's ModelStep for one session; `turns` holds what it sampled, in order, and `offered`
    the names of the tools the adapter offered the model."""

    def __init__(self, loop: AsyncRolloutLoop, event_loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.event_loop = event_loop
        self.turns: list[TurnRecord] = []
        self.offered: set[str] = set()

    def __call__(
        self, messages: list[dict[str, Any]], tools: list, sampling: dict[str, Any]
    ) -> ModelStepResult:
        # `sampling` is the adapter's wish; the run's settings are what the importance ratios assume.
        config = self.loop.config
        self.offered.update(tool.name for tool in tools or [])
        schemas = tool_schemas(tools) if tools else None
        prompt_ids = render_prompt_ids(
            self.loop.tokenizer, template_messages(messages), schemas, config.chat_template_kwargs
        )
        turn = asyncio.run_coroutine_threadsafe(
            self.loop.generate_one_turn(prompt_ids), self.event_loop
        ).result()
        self.turns.append(turn)
        parsed = parse_sampled_turn(self.loop.tokenizer, turn, bool(tools), config.parse_reasoning)
        calls = [
            ToolCall(id=f"call_{len(self.turns)}_{index}", name=call.name, args=call.arguments)
            for index, call in enumerate(call for call in parsed.calls if call.error is None)
        ]
        return ModelStepResult(
            response=LLMResponse(content=parsed.content, tool_calls=calls),
            prompt_ids=list(turn.prompt_ids),
            completion_ids=list(turn.output_ids),
            logprobs=list(turn.output_log_probs),
        )
