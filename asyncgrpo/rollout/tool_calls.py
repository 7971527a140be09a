"""Reading an assistant turn: its tool calls and its reasoning.

The call format is the one the chat template teaches (`tool_call_format`); each is written by the
families people train agents on (docs/agents.md has the table, the format of each and where it
comes from):
  - "hermes" (Qwen2.5, Qwen3, Hermes 3 and most ChatML tool models): one
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block per call;
  - "xml" (Qwen3.5 and later, Qwen3-Coder): `<tool_call><function=NAME><parameter=P>value</parameter>
    ...</function></tool_call>`;
  - "glm45" (GLM-4.5, GLM-4.6): `<tool_call>NAME<arg_key>P</arg_key><arg_value>value</arg_value>...
    </tool_call>`;
  - "deepseek" (DeepSeek-V3, R1): `<｜tool▁calls▁begin｜>` then per call `<｜tool▁call▁begin｜>function
    <｜tool▁sep｜>NAME` and the arguments in a ```json fence (V3.1 and later write `NAME<｜tool▁sep｜>
    {json}`), `<｜tool▁call▁end｜>`, and `<｜tool▁calls▁end｜>`;
  - "harmony" (gpt-oss): a message to the recipient `functions.NAME` in the commentary channel,
    `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{json}<|call|>`;
  - "mistral": `[TOOL_CALLS]` followed by a JSON list of {"name", "arguments"} objects (Mistral-Nemo
    and earlier), or `[TOOL_CALLS]NAME[CALL_ID]id[ARGS]{json}` per call (Mistral Small 3.2 and later);
  - "llama3_json" (Llama 3.1 to 3.3): the whole turn is one `{"name": ..., "parameters": {...}}`
    object, with no marker: a turn that starts with `{` is a call.
In the xml and glm45 formats every value is text, converted to the type the tool's schema gives it
when the call runs (rollout/agent.py). A call that cannot be read (not valid JSON, no name,
arguments that are not an object) is kept as a malformed call: the loop answers it with an error
message the model sees and counts it as a failure, it never stops the run. A template that teaches
none of these formats gives None, and a run with tools refuses it at start (`require_call_format`).

Reasoning: a `<think>...</think>` block (the opening tag may sit in the generation prompt) is found
in every turn; calls are read only after it (a call the model muses about while reasoning is not
made). gpt-oss reasons in its analysis channel instead. Whether reasoning then stays in `content`
or moves to `reasoning_content` is the caller's choice (`parse_reasoning`, docs/agents.md#reasoning).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from asyncgrpo.errors import ConfigurationError

# What a template must declare for each format, tried in this order (GLM-4.5 and Qwen3.5 declare
# `<tool_call>` too, so they come before hermes).
_DEEPSEEK_BEGIN, _DEEPSEEK_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DEEPSEEK_CALL, _DEEPSEEK_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
_DEEPSEEK_SEP = "<｜tool▁sep｜>"
_MISTRAL_MARK = "[TOOL_CALLS]"
_LLAMA3_MARK = "dictionary of argument name and its value"  # the call format Llama 3.1+ templates state
_DECLARATIONS: list[tuple[str, tuple[str, ...]]] = [
    ("deepseek", (_DEEPSEEK_BEGIN,)),
    ("harmony", ("<|channel|>", "<|call|>")),
    ("glm45", ("<tool_call>", "<arg_key>")),
    ("xml", ("<tool_call>", "<function=")),
    ("hermes", ("<tool_call>",)),
    ("mistral", (_MISTRAL_MARK,)),
    ("llama3_json", (_LLAMA3_MARK,)),
]
CALL_FORMATS = {
    "hermes": "Qwen2.5, Qwen3, Hermes: <tool_call>{json}</tool_call>",
    "xml": "Qwen3.5, Qwen3-Coder: <tool_call><function=NAME><parameter=P>",
    "glm45": "GLM-4.5, GLM-4.6: <tool_call>NAME<arg_key>P</arg_key><arg_value>",
    "deepseek": "DeepSeek-V3, R1: <｜tool▁calls▁begin｜>",
    "harmony": "gpt-oss: <|channel|>commentary to=functions.NAME",
    "mistral": "Mistral: [TOOL_CALLS]",
    "llama3_json": 'Llama 3.1-3.3: {"name": ..., "parameters": ...}',
}
# The markers each format is read by (reasoning's included). A tokenizer may make one a special
# token, which decoding with skip_special_tokens drops: the loop keeps these (turn_text). Other
# end-of-turn tokens are dropped and the template writes them back; gpt-oss's `<|call|>` is kept,
# since its training template renders a turn that called exactly as it was sampled.
FORMAT_MARKERS = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "xml": ("<tool_call>", "</tool_call>"),
    "glm45": ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    "deepseek": (_DEEPSEEK_BEGIN, _DEEPSEEK_END, _DEEPSEEK_CALL, _DEEPSEEK_CALL_END, _DEEPSEEK_SEP),
    "harmony": ("<|start|>", "<|end|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|call|>"),
    "mistral": (_MISTRAL_MARK, "[CALL_ID]", "[ARGS]"),
    "llama3_json": ("<|python_tag|>",),
}
REASONING_MARKERS = ("<think>", "</think>")

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_XML_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|$)", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>", re.DOTALL)
_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_DEEPSEEK_BLOCK = re.compile(
    re.escape(_DEEPSEEK_CALL) + r"(.*?)(?:" + re.escape(_DEEPSEEK_CALL_END) + r"|$)", re.DOTALL
)
_DEEPSEEK_FENCE = re.compile(r"```(?:json)?\s*\n?(.*?)(?:\n?```|$)", re.DOTALL)
# One harmony message of the turn (the first one's `<|start|>assistant` is in the generation
# prompt): the recipient may sit in the role header (`assistant to=functions.f<|channel|>...`) or
# after the channel (`<|channel|>commentary to=functions.f <|constrain|>json<|message|>`).
_HARMONY_MESSAGE = re.compile(
    r"(?:<\|start\|>assistant)?(?P<head>[^<]*)<\|channel\|>(?P<channel>[^<]*)(?:<\|constrain\|>[^<]*)?"
    r"<\|message\|>(?P<body>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|(?=<\|start\|>)|$)",
    re.DOTALL,
)
_HARMONY_RECIPIENT = re.compile(r"to=(\S+)")


@dataclass
class ToolCall:
    name: str | None  # None when the call could not be read
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why the call is malformed, if it is
    # The arguments are text to convert by the tool's schema (the xml and glm45 formats write no
    # JSON types).
    text_arguments: bool = False
    id: str | None = None  # the call id the model wrote (Mistral), if any

    def as_message_entry(self) -> dict[str, Any]:
        """The call in the chat-message form templates and reward functions expect."""
        return {"type": "function", "function": {"name": self.name or "", "arguments": self.arguments}}


@dataclass
class ParsedTurn:
    content: str  # the text without tool-call blocks (and without the reasoning block when split)
    calls: list[ToolCall]
    reasoning: str | None = None  # the reasoning block's text when split off, else None


def tool_call_format(chat_template: Any) -> str | None:
    """The call format the template teaches (a key of CALL_FORMATS), or None when it declares none
    that asyncgrpo reads."""
    if not isinstance(chat_template, str):
        return None
    for fmt, declared in _DECLARATIONS:
        if all(marker in chat_template for marker in declared):
            return fmt
    return None


def require_call_format(chat_template: Any, model_id: str) -> str:
    """The template's call format; a ValueError naming the supported ones when it has none (a run
    with tools would otherwise never see a call, and end every rollout after one turn)."""
    fmt = tool_call_format(chat_template)
    if fmt is None:
        supported = "; ".join(f"{name} ({families})" for name, families in CALL_FORMATS.items())
        raise ConfigurationError(
            f"tools or an environment are on, but the chat template of {model_id!r} teaches no tool-call "
            f"format the tool loop reads, so no call of the model would ever run. Supported formats: "
            f"{supported}. Train a model of one of these families, or pass a processing_class whose "
            "chat_template teaches one of them (docs/agents.md, 'Tool-call formats')."
        )
    return fmt


def _read_arguments(name: str | None, arguments: Any, call_id: Any = None) -> ToolCall:
    """A call from its name and its arguments (a JSON object, or text holding one)."""
    call_id = call_id if isinstance(call_id, str) else None
    if not name:
        return ToolCall(None, error="a tool call must name its function", id=call_id)
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            return ToolCall(name, error=f"the arguments are not valid JSON ({error.msg})", id=call_id)
    if not isinstance(arguments, dict):
        return ToolCall(name, error='"arguments" must be a JSON object', id=call_id)
    return ToolCall(name, arguments, id=call_id)


def _read_call(payload: Any) -> ToolCall:
    """One `{"name": ..., "arguments": {...}}` call (also "parameters"; arguments may be JSON text)."""
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except json.JSONDecodeError as error:
            return ToolCall(None, error=f"the tool call is not valid JSON ({error.msg} at char {error.pos})")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall(None, error='a tool call must be a JSON object with a "name" string')
    arguments = payload.get("arguments", payload.get("parameters", {}))
    return _read_arguments(payload["name"], arguments, payload.get("id"))


def typed_arguments(arguments: dict[str, str], properties: dict[str, Any]) -> dict[str, Any]:
    """Text arguments (xml and glm45 formats) converted by the tool's JSON schema: a string parameter
    keeps its text, any other is read as JSON (`3`, `true`, `[1, 2]`); a value that does not read
    keeps its text, and the tool's own failure on it becomes the model's observation."""
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


def _read_glm_call(block: str) -> ToolCall:
    name = block.split("<arg_key>", 1)[0].strip()
    if not name or "\n" in name or "<" in name:
        return ToolCall(None, error="a tool call must start with the function's name")
    pairs = _GLM_ARGUMENT.findall(block)
    if len(pairs) != block.count("<arg_key>"):
        return ToolCall(name, error="each <arg_key> must be followed by its <arg_value>")
    return ToolCall(name, {key.strip(): value for key, value in pairs}, text_arguments=True)


def _read_deepseek_call(block: str) -> ToolCall:
    kind, sep, rest = block.partition(_DEEPSEEK_SEP)
    if not sep:
        return ToolCall(None, error=f"a tool call must hold {_DEEPSEEK_SEP} after its type")
    if kind.strip() == "function" or "```" in rest:  # V3/R1: `function<sep>NAME` and a ```json fence
        name, _, fenced = rest.partition("\n")
        body = _DEEPSEEK_FENCE.search(fenced)
        return _read_arguments(name.strip(), body.group(1) if body else fenced)
    return _read_arguments(kind.strip(), rest)  # V3.1 and later: `NAME<sep>{json}`


def _read_mistral_calls(tail: str) -> list[ToolCall]:
    """What follows the first [TOOL_CALLS]: a JSON list (or object) of calls, or one or more
    `NAME[CALL_ID]id[ARGS]{json}` calls, each after its own [TOOL_CALLS]."""
    if tail.lstrip().startswith(("[", "{")):
        try:
            payload = json.loads(tail.strip())
        except json.JSONDecodeError as error:
            return [ToolCall(None, error=f"the tool calls are not valid JSON ({error.msg})")]
        return [_read_call(entry) for entry in (payload if isinstance(payload, list) else [payload])]
    calls = []
    for chunk in tail.split(_MISTRAL_MARK):
        head, sep, arguments = chunk.partition("[ARGS]")
        if not sep:
            calls.append(ToolCall(None, error="a tool call must be NAME[ARGS]{arguments}"))
            continue
        name, _, call_id = head.partition("[CALL_ID]")
        calls.append(_read_arguments(name.strip(), arguments, call_id.strip() or None))
    return calls


def _harmony_messages(text: str):
    """(span, channel, recipient or None, body) of each harmony message of a turn."""
    for match in _HARMONY_MESSAGE.finditer(text):
        header = match.group("head") + " " + match.group("channel")
        recipient = _HARMONY_RECIPIENT.search(header)
        channel = match.group("channel").split(" ")[0].strip()
        yield match.span(), channel, recipient.group(1) if recipient else None, match.group("body")


def _parse_harmony(text: str, with_tools: bool, reasoning: bool) -> ParsedTurn:
    """gpt-oss's turn: its calls are the messages to a recipient (`functions.NAME`), its reasoning
    the analysis channel, its answer the final channel."""
    messages = list(_harmony_messages(text))
    calls, kept, last = [], [], 0
    for (start, end), _, recipient, body in messages:
        if with_tools and recipient is not None:
            calls.append(_read_arguments(recipient.removeprefix("functions."), body.strip()))
            kept.append(text[last:start])
            last = end
    if not reasoning or not messages:
        return ParsedTurn(content="".join([*kept, text[last:]]), calls=calls)
    analysis = [body for _, channel, _, body in messages if channel == "analysis"]
    answer = [body for _, channel, to, body in messages if channel != "analysis" and to is None]
    return ParsedTurn("".join(answer), calls, reasoning="\n".join(analysis) if analysis else None)


def parse_tool_calls(text: str, fmt: str | None = "hermes") -> tuple[str, list[ToolCall]]:
    """(the text without the calls, the calls in the order emitted)."""
    if fmt == "mistral":
        head, mark, tail = text.partition(_MISTRAL_MARK)
        return (head, _read_mistral_calls(tail)) if mark else (text, [])
    if fmt == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        return ("", [_read_call(body)]) if body.startswith("{") else (text, [])
    if fmt == "deepseek":
        head, mark, tail = text.partition(_DEEPSEEK_BEGIN)
        if not mark:
            return text, []
        block, _, after = tail.partition(_DEEPSEEK_END)
        calls = [_read_deepseek_call(call) for call in _DEEPSEEK_BLOCK.findall(block)]
        return (head + after).strip(), calls or [ToolCall(None, error=f"no {_DEEPSEEK_CALL} after {mark}")]
    if fmt == "harmony":
        parsed = _parse_harmony(text, with_tools=True, reasoning=False)
        return parsed.content, parsed.calls
    if fmt not in ("hermes", "xml", "glm45"):
        raise ConfigurationError(f"unknown tool-call format {fmt!r}: one of {', '.join(CALL_FORMATS)}")
    read = {"hermes": _read_call, "xml": _read_xml_call, "glm45": _read_glm_call}[fmt]
    calls = [read(block.strip()) for block in _BLOCK.findall(text)]
    if not calls:
        return text, []
    return _BLOCK.sub("", text).strip(), calls


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning or None, the rest). Only a reasoning block that closes counts: a turn cut off
    inside its reasoning keeps everything in content."""
    before, mark, after = text.partition("</think>")
    if not mark:
        return None, text
    reasoning = before.split("<think>", 1)[-1].strip("\n")
    return reasoning, after.lstrip("\n")


def parse_turn(text: str, fmt: str | None, with_tools: bool, reasoning: bool) -> ParsedTurn:
    """An assistant turn's content, calls (only looked for when tools are offered, and only after the
    reasoning block) and reasoning. `reasoning=True` moves the reasoning block out of `content` into
    `reasoning`; False keeps `content` as generated, less the call blocks."""
    if fmt == "harmony":
        return _parse_harmony(text, with_tools, reasoning)
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
