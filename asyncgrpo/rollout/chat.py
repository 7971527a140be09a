"""Rendering conversations to token ids with the chat template, tools included.

One helper (`render_prompt_ids`) is used everywhere a prompt becomes tokens (the rollout loop, the
trainer's prompt-length check, the demo's warm start), so the trainer measures exactly what the
worker sends. Tools are offered to the template as JSON schemas built from type hints and
Google-style docstrings (transformers' `get_json_schema`), with a plainer schema when a tool has no
usable docstring: the model still sees its name and typed parameters.

A tool loop re-renders the whole conversation every turn. A template that rewrites earlier turns
(Qwen3 drops the reasoning of assistant turns before the last user query) makes a turn's prompt
differ from the tokens kept so far, which forks the training sample (rollout/sequences.py). Known
families get a prefix-preserving training template when tools are on (rollout/training_templates.py);
RewriteDetector warns about the others.
"""

from __future__ import annotations

import functools
import inspect
import logging
import typing
from typing import Any, Callable

from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

logger = logging.getLogger(__name__)

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


def _plain_schema(tool: Callable) -> dict[str, Any]:
    """Name, first docstring line and typed parameters, for a tool whose docstring does not parse."""
    signature = inspect.signature(tool)
    hints = typing.get_type_hints(tool) if not isinstance(tool, functools.partial) else {}
    properties, required = {}, []
    for name, parameter in signature.parameters.items():
        if name == "self" or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        hint = typing.get_origin(hints.get(name)) or hints.get(name)
        properties[name] = {"type": _JSON_TYPES[hint]} if hint in _JSON_TYPES else {}
        if parameter.default is parameter.empty:
            required.append(name)
    doc = inspect.getdoc(tool) or ""
    return {
        "type": "function",
        "function": {
            "name": tool_name(tool),
            "description": doc.strip().splitlines()[0] if doc.strip() else "",
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def tool_name(tool: Callable) -> str:
    """The name the model calls a tool by: its `__name__` (a partial's target's)."""
    while isinstance(tool, functools.partial):
        tool = tool.func
    return tool.__name__


@functools.lru_cache(maxsize=4096)
def _schema_of(function: Callable) -> dict[str, Any]:
    try:
        return get_json_schema(function)
    except (DocstringParsingException, TypeHintParsingException) as error:
        logger.warning(
            "tool %r: %s; it is offered with its name and typed parameters only. Give it a Google-style "
            "docstring (a description and an Args: section) so the model knows what it does.",
            tool_name(function),
            error,
        )
        return _plain_schema(function)


def tool_schema(tool: Callable) -> dict[str, Any]:
    """The JSON schema of one tool. Bound methods (environment tools) are cached by their function
    (whose schema leaves `self` out): every instance of an environment class offers the same one."""
    return _schema_of(getattr(tool, "__func__", tool))


def render_prompt_ids(
    tokenizer,
    messages: list[dict[str, Any]],
    tools: list[Callable | dict[str, Any]] | None = None,
    chat_template_kwargs: dict | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The conversation's token ids through the chat template, with the tools' schemas (a tool is a
    function, or already a schema: an agent's OpenAI-format tools, rollout/harness's capture)."""
    rendered = tokenizer.apply_chat_template(
        messages,
        tools=[tool if isinstance(tool, dict) else tool_schema(tool) for tool in tools] if tools else None,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        **(chat_template_kwargs or {}),
    )
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


class RenderCache:
    """A group's prompt rendered once for all its rollouts when they share the prompt (an
    environment's reset() may give each its own): `render` caches per group id, `forget` drops a
    group once its rollouts are done."""

    def __init__(self, tokenizer, chat_template_kwargs: dict | None):
        self.tokenizer = tokenizer
        self.chat_template_kwargs = chat_template_kwargs
        self._by_group: dict[int, tuple[list[dict[str, Any]], list[int]]] = {}

    def render(self, prompt: list[dict[str, Any]], tools: list[Callable], group_id: int) -> list[int]:
        """The prompt's token ids through the chat template, with the tools' schemas."""
        cached = self._by_group.get(group_id)
        if cached is not None and cached[0] is prompt:
            return cached[1]
        ids = render_prompt_ids(self.tokenizer, prompt, tools, self.chat_template_kwargs)
        self._by_group[group_id] = (prompt, ids)
        return ids

    def forget(self, group_id: int) -> None:
        self._by_group.pop(group_id, None)


class RewriteDetector:
    """Warns once when an unknown template re-renders earlier turns differently (a fork between
    turns), which costs forwarded tokens on every multi-turn rollout."""

    def __init__(self) -> None:
        self.warned = False

    def observe(self, transitions: int, forks: int) -> None:
        if forks and not self.warned:
            self.warned = True
            logger.warning(
                "in %d of %d turn transitions of a rollout the next prompt did not start with the tokens "
                "kept so far: each such turn starts a new training sample (a fork). Either the chat "
                "template rewrites earlier turns, or the model sampled tokens that its text does not "
                "encode back to. Watch rollout/fork_frac and rollout/drift_tokens_mean: occasional forks "
                "are re-encodings, frequent ones a template that rewrites history, which a "
                "prefix-preserving template (appending a message never changes how earlier ones render) "
                "avoids.",
                forks,
                transitions,
            )
