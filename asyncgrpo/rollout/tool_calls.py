"""Reading an assistant turn: its tool calls and its reasoning.

Formats, picked from what the chat template declares:
  - "hermes" (Qwen2.5/Qwen3, Hermes and most ChatML tool models): one
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block per call;
  - "xml" (Qwen3.5 and later, Qwen3-Coder): `<tool_call><function=NAME><parameter=P>value</parameter>
    ...</function></tool_call>`; each value is text, converted to the type the tool's schema gives
    it when the call runs (rollout/tools.py);
  - "mistral": `[TOOL_CALLS]` followed by a JSON list of {"name", "arguments"} objects;
  - "llama3_json" (Llama 3.1 to 3.3): the whole turn is one `{"name": ..., "parameters": {...}}`
    object, with no marker: a turn that starts with `{` is a call.
A block that is not valid JSON, lacks a name, or has non-object arguments is kept as a malformed
call: the loop answers it with an error message the model sees and counts it as a failure, it never
stops the run.

Reasoning: a Qwen3-style `<think>...</think>` block (the opening tag may sit in the generation
prompt) is found in every turn; calls are read only after it (a call the model muses about while
reasoning is not made). Whether it then stays in `content` or moves to `reasoning_content` is the
caller's choice (`parse_reasoning`, docs/agents.md#reasoning).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_XML_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|$)", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>", re.DOTALL)
_XML_MARK = "<function="
_MISTRAL_MARK = "[TOOL_CALLS]"
_LLAMA3_MARK = "dictionary of argument name and its value"  # the call format Llama 3.1+ templates state
# The markers each format is read by (reasoning's included). A tokenizer may make one a special
# token, which decoding with skip_special_tokens drops: the loop keeps these (turn_text).
FORMAT_MARKERS = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "xml": ("<tool_call>", "</tool_call>"),
    "mistral": (_MISTRAL_MARK,),
}
REASONING_MARKERS = ("<think>", "</think>")


@dataclass
class ToolCall:
    name: str | None  # None when the call could not be read
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why the call is malformed, if it is
    # The arguments are text to convert by the tool's schema (the "xml" format writes no JSON types).
    text_arguments: bool = False

    def as_message_entry(self) -> dict[str, Any]:
        """The call in the chat-message form templates and reward functions expect."""
        return {"type": "function", "function": {"name": self.name or "", "arguments": self.arguments}}


@dataclass
class ParsedTurn:
    content: str  # the text without tool-call blocks (and without the reasoning block when split)
    calls: list[ToolCall]
    reasoning: str | None = None  # the reasoning block's text when split off, else None


def tool_call_format(chat_template: Any) -> str:
    """The call format the template teaches: "hermes" unless it declares another."""
    template = chat_template if isinstance(chat_template, str) else ""
    if "<tool_call>" in template and _XML_MARK in template:
        return "xml"
    if _MISTRAL_MARK in template and "<tool_call>" not in template:
        return "mistral"
    if _LLAMA3_MARK in template and "<tool_call>" not in template:
        return "llama3_json"
    return "hermes"


def _read_call(payload: Any) -> ToolCall:
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except json.JSONDecodeError as error:
            return ToolCall(None, error=f"the tool call is not valid JSON ({error.msg} at char {error.pos})")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall(None, error='a tool call must be a JSON object with a "name" string')
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            return ToolCall(payload["name"], error=f"the arguments are not valid JSON ({error.msg})")
    if not isinstance(arguments, dict):
        return ToolCall(payload["name"], error='"arguments" must be a JSON object')
    return ToolCall(payload["name"], arguments)


def typed_arguments(arguments: dict[str, str], properties: dict[str, Any]) -> dict[str, Any]:
    """Text arguments ("xml" format) converted by the tool's JSON schema: a string parameter keeps
    its text, any other is read as JSON (`3`, `true`, `[1, 2]`); a value that does not read keeps
    its text, and the tool's own failure on it becomes the model's observation."""
    typed: dict[str, Any] = {}
    for name, value in arguments.items():
        kind = properties.get(name, {}).get("type")
        if kind == "string" or (isinstance(kind, list) and "string" in kind):
            typed[name] = value
            continue
        try:
            typed[name] = json.loads(value.strip().lower() if kind == "boolean" else value)
        except json.JSONDecodeError:
            typed[name] = value
    return typed


def _read_xml_call(block: str) -> ToolCall:
    function = _XML_FUNCTION.search(block)
    if function is None or not function.group(1).strip():
        return ToolCall(None, error="a tool call must hold a <function=NAME> block")
    arguments = {name.strip(): value for name, value in _XML_PARAMETER.findall(function.group(2))}
    return ToolCall(function.group(1).strip(), arguments, text_arguments=True)


def parse_tool_calls(text: str, fmt: str = "hermes") -> tuple[str, list[ToolCall]]:
    """(the text without the calls, the calls in the order emitted)."""
    if fmt == "mistral":
        head, mark, tail = text.partition(_MISTRAL_MARK)
        if not mark:
            return text, []
        try:
            payload = json.loads(tail.strip())
        except json.JSONDecodeError as error:
            return head, [ToolCall(None, error=f"the tool calls are not valid JSON ({error.msg})")]
        payload = payload if isinstance(payload, list) else [payload]
        return head, [_read_call(entry) for entry in payload]
    if fmt == "llama3_json":
        body = text.strip()
        if not body.startswith("{"):
            return text, []
        return "", [_read_call(body)]
    read = _read_xml_call if fmt == "xml" else _read_call
    calls = [read(block.strip()) for block in _HERMES_BLOCK.findall(text)]
    if not calls:
        return text, []
    return _HERMES_BLOCK.sub("", text).strip(), calls


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning or None, the rest). Only a reasoning block that closes counts: a turn cut off
    inside its reasoning keeps everything in content."""
    before, mark, after = text.partition("</think>")
    if not mark:
        return None, text
    reasoning = before.split("<think>", 1)[-1].strip("\n")
    return reasoning, after.lstrip("\n")


def parse_turn(text: str, fmt: str, with_tools: bool, reasoning: bool) -> ParsedTurn:
    """An assistant turn's content, calls (only looked for when tools are offered, and only after the
    reasoning block) and reasoning. `reasoning=True` moves the reasoning block out of `content` into
    `reasoning`; False keeps `content` as generated, less the call blocks."""
    head, mark, tail = text.partition("</think>")
    head, tail = (head + mark, tail) if mark else ("", text)  # head: the reasoning block, if closed
    rest, calls = parse_tool_calls(tail, fmt) if with_tools else (tail, [])
    if reasoning and head:
        return ParsedTurn(content=rest.lstrip("\n"), calls=calls, reasoning=split_reasoning(head)[0])
    if not calls:
        return ParsedTurn(content=text, calls=[])
    if head and rest.strip():  # keep what separated the reasoning from the text around the calls
        rest = tail[: len(tail) - len(tail.lstrip())] + rest.lstrip()
    return ParsedTurn(content=head + rest, calls=calls)
