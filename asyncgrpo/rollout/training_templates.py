"""Training templates: the chat templates a tool loop renders with, for families whose own
template would not reproduce the tokens a turn sampled.

A tool loop re-renders the whole conversation every turn, each sampled turn kept as the text it was
(rollout/agent.py). A template that renders that text differently from how it was sampled (drops
the reasoning of earlier turns, renders tool results one way when last and another way later,
refuses a sampled turn in the history) makes the next prompt differ from the tokens kept so far,
which forks the training sample (rollout/sequences.py); one that raises stops the rollout. When tools
or an environment are on, known families get a prefix-preserving template instead (docs/agents.md,
"Multi-turn samples"):

  - Qwen3: replaced whole by QWEN3_TRAINING_TEMPLATE;
  - Hermes 3, DeepSeek-V3/R1, gpt-oss and Mistral: the model's own template with the few parts
    that break the tool loop rewritten (FAMILY_PATCHES, each saying why). The rest (the system
    prompt, how tools are offered) stays the model's own, whatever its revision; a revision whose
    text no longer holds a patched part keeps that part as it is.

GLM-4.5/4.6, Llama 3.1-3.3, Qwen2.5 and Qwen3.5 need nothing: their templates render a sampled turn
as it was sampled.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Qwen3's chat template without its rewriting of earlier assistant turns: every message renders the
# same whatever follows it. Assistant content is rendered verbatim (reasoning included), structured
# tool calls in Qwen3's `<tool_call>` form, tool results as `<tool_response>` blocks of a user turn.
# With enable_thinking=False the generation prompt holds an empty think block; past assistant turns
# render it too, so the history reproduces what the model was prompted with.
QWEN3_TRAINING_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.reasoning_content is string and message.reasoning_content %}
{%- set content = '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') %}
{%- endif %}
{%- if enable_thinking is defined and enable_thinking is false and not content.startswith('<think>') %}
{%- set content = '<think>\\n\\n</think>\\n\\n' + content %}
{%- endif %}
{{- '<|im_start|>assistant\\n' + content }}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
{%- if loop.first and content or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""


def _is_qwen3_template(template: str) -> bool:
    # Qwen3 (and Qwen3-style fine-tunes) find the last real user query to decide whose reasoning to drop.
    # Qwen3.5 and later do too, but call tools in another format (`<function=NAME>` blocks) and render
    # images: the Qwen3 training template would teach them a format they do not know.
    return (
        "<tool_call>" in template
        and "last_query_index" in template
        and "reasoning_content" in template
        and "<function=" not in template
    )


@dataclass(frozen=True)
class FamilyPatch:
    """Rewrites of a family's template: `declares` identifies the family (every marker is in its
    template); each (old, new) pair replaces a part of the template that breaks the tool loop."""

    family: str
    declares: tuple[str, ...]
    rewrites: tuple[tuple[str, str], ...]

    def apply(self, template: str) -> str | None:
        """The patched template, or None when this is not the family's or nothing of it applies."""
        if not all(marker in template for marker in self.declares):
            return None
        patched = template
        for old, new in self.rewrites:
            if patched.count(old) == 1:
                patched = patched.replace(old, new)
        return patched if patched != template else None


# The gpt-oss template renders an assistant message from structured fields (`thinking`, `content` in
# the final channel, `tool_calls` as a commentary message it writes itself) and refuses channel tags
# in `content`; a sampled turn is raw harmony text (`<|channel|>analysis<|message|>...<|end|><|start|>
# assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>`). The patch
# renders such a turn as sampled after the `<|start|>assistant` of its generation prompt, ends a turn
# that did not stop on `<|call|>` with `<|end|>` as the template does, and remembers the recipient of
# its last message, which the template's tool messages are addressed from.
_HARMONY_SAMPLED_TURN = (
    "{%- if message.role == 'assistant' and message.content is string and "
    "(message.content.startswith('<|channel|>') or message.content.startswith(' to=')) -%}"
    "{{- '<|start|>assistant' + message.content }}"
    "{%- if not message.content.endswith('<|call|>') %}{{- '<|end|>' }}{%- endif %}"
    "{%- if ' to=' in message.content %}"
    "{%- set last_tool_call.name = message.content.split(' to=')[-1].split('<|')[0].split(' ')[0]"
    " | replace('functions.', '') %}"
    "{%- else %}{%- set last_tool_call.name = none %}{%- endif %}"
    "{%- elif message.role == 'assistant' -%}"
)

FAMILY_PATCHES = (
    # Hermes 3 ends a tool message with "\n</tool_response>" when it is the last message (the
    # generation prompt follows) but with "\n</tool_response>\n" once anything follows: every
    # tool turn would fork. The patch keeps the form the model was prompted with, the newline only
    # between two tool messages.
    FamilyPatch(
        "Hermes",
        ("<tool_call>", "Use the following pydantic model json schema for each tool call you will make"),
        (
            (
                "{%- if not loop.last %}\n            {{- '\n</tool_response>\n' }}",
                '{%- if not loop.last and loop.nextitem.role == "tool" %}\n'
                "            {{- '\n</tool_response>\n' }}",
            ),
        ),
    ),
    # DeepSeek-V3/R1 re-render an earlier assistant turn without its reasoning (everything up to
    # `</think>`) while R1's generation prompt opens the reasoning (`<｜Assistant｜><think>\n`):
    # the patch keeps the reasoning and restores the opening the generation prompt wrote.
    FamilyPatch(
        "DeepSeek",
        ("<｜tool▁calls▁begin｜>", "<｜Assistant｜>"),
        (
            (
                "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}",
                "{% if '</think>' in content and not content.startswith('<think>') %}"
                "{% set content = '<think>\\n' + content %}{% endif %}",
            ),
        ),
    ),
    FamilyPatch(
        "gpt-oss",
        ("<|channel|>", "<|call|>"),
        (("{%- if message.role == 'assistant' -%}", _HARMONY_SAMPLED_TURN),),
    ),
    # Mistral's templates refuse two assistant messages in a row unless the first carries structured
    # `tool_calls`; a sampled turn is text, so the turn after a tool result would be refused. Mistral
    # Nemo and earlier also put the system message into the user message only while that is the last
    # message: once a tool result follows, the system message leaves the prompt. The patch keeps it in
    # the last user message, where the tools are offered too. (Tool results name their call by a
    # 9-character `tool_call_id`, which the tool loop gives every tool message.)
    FamilyPatch(
        "Mistral",
        ("[TOOL_CALLS]", "[INST]"),
        (
            (
                '{{- raise_exception("After the optional system message, conversation roles must alternate '
                'user/assistant/user/assistant/...") }}',
                "",
            ),
            (
                "{%- if loop.last and system_message is defined %}",
                "{%- if message == user_messages[-1] and system_message is defined %}",
            ),
        ),
    ),
)


def use_training_template(tokenizer) -> bool:
    """Give a known family's tokenizer its prefix-preserving training template (called when tools or
    an environment are on). Returns whether the template changed."""
    template = tokenizer.chat_template
    if not isinstance(template, str):
        return False
    if _is_qwen3_template(template):
        tokenizer.chat_template = QWEN3_TRAINING_TEMPLATE
        logger.info(
            "tools are on: the Qwen3 chat template is replaced by its prefix-preserving training template"
        )
        return True
    for patch in FAMILY_PATCHES:
        patched = patch.apply(template)
        if patched is not None:
            tokenizer.chat_template = patched
            logger.info(
                "tools are on: the %s chat template renders sampled turns as they were sampled (its training "
                "template, docs/agents.md)",
                patch.family,
            )
            return True
    return False
