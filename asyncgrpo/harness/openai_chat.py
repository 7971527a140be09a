"""The OpenAI chat-completions view of a sampled turn: an agent's request made renderable by the
chat template, and the sampled tokens made into the reply the agent reads.

The agent sends its history in OpenAI's form (tool-call arguments as JSON strings, `content: null`
beside tool calls); chat templates expect the arguments as objects and content as text. The reply
carries the turn's text less its tool-call blocks, and the calls as OpenAI `tool_calls`, parsed by
the same code as the built-in tool loop (rollout/tool_calls.py), so an agent sees what the trainer
would have seen.
"""

from __future__ import annotations

import json
import time
from typing import Any

from asyncgrpo.rollout.agent import turn_text
from asyncgrpo.rollout.tool_calls import ParsedTurn, parse_turn, require_call_format, tool_call_format
from asyncgrpo.rollout.types import TurnRecord


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The agent's messages as chat templates read them: tool-call arguments decoded from JSON,
    `content` text (never null)."""
    converted = []
    for message in messages:
        message = dict(message)
        if message.get("content") is None:
            message["content"] = ""
        calls = []
        for call in message.get("tool_calls") or []:
            function = dict(call.get("function") or {})
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    function["arguments"] = json.loads(arguments) if arguments.strip() else {}
                except json.JSONDecodeError:
                    pass  # left as text: the template writes it verbatim
            calls.append({**call, "function": function})
        if calls:
            message["tool_calls"] = calls
        converted.append(message)
    return converted


def parse_sampled_turn(tokenizer, turn: TurnRecord, with_tools: bool, parse_reasoning: bool) -> ParsedTurn:
    """The sampled turn's content, tool calls and reasoning, read as the built-in tool loop reads them."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    fmt = require_call_format(template, "the served model") if with_tools else tool_call_format(template)
    return parse_turn(turn_text(tokenizer, turn.output_ids, fmt), fmt, with_tools, parse_reasoning)


def chat_completion(parsed: ParsedTurn, turn: TurnRecord, model: str, call_id_prefix: str) -> dict[str, Any]:
    """The chat.completion object of one sampled turn. Malformed calls are left out of `tool_calls`
    (their text stays in the sampled tokens, which is what is trained)."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    calls = [call for call in parsed.calls if call.error is None]
    if calls:
        message["tool_calls"] = [
            {
                "id": f"{call_id_prefix}_{index}",
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
            }
            for index, call in enumerate(calls)
        ]
    return {
        "id": f"chatcmpl-{call_id_prefix}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if calls else (turn.finish_reason or "stop"),
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": len(turn.prompt_ids),
            "completion_tokens": len(turn.output_ids),
            "total_tokens": len(turn.prompt_ids) + len(turn.output_ids),
        },
    }
