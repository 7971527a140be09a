"""Tool calls of every chat family the tool loop reads, each with the family's real chat template
(tests/data/chat_templates/, the README there says where each comes from).

Per family: the call format is read from the template; the parser reads back the calls the template
renders and the calls the model writes; a multi-turn rollout (a call, a malformed call, an answer)
re-renders each turn as it was sampled, so the rollout stays one training sample with each sampled
token trained once, with the family's training template where its own template would fork or refuse
(shown too); and the same rollout runs against the real vLLM server. A template whose calls cannot be
read is refused when the trainer is built.

The test tokenizers are the tiny model's byte-level BPE with the family's template and markup tokens
(`Family.tokenizer`), within the tiny model's vocabulary so that the server can take their ids. The
family's call markers are special tokens in them (as gpt-oss's and Mistral's are in the real
tokenizers), which decoding with skip_special_tokens would drop: the hardest case for reading a turn.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from dataclasses import dataclass, field, replace

import pytest
from support_paths import DATA

pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

from agent_fakes import ScriptedLoop, assert_each_generated_token_trained_once, multiply  # noqa: E402
from jinja2 import TemplateError  # noqa: E402

from asyncgrpo.cli.tiny_model import ChatTokens, build_tokenizer  # noqa: E402
from asyncgrpo.generation.client import SamplingParams, VLLMClient  # noqa: E402
from asyncgrpo.rollout.agent import (  # noqa: E402
    record_tool_rollout_metrics,
    run_tool_loop,
    turn_text,
    type_text_arguments,
)
from asyncgrpo.rollout.chat import render_prompt_ids, tool_schema  # noqa: E402
from asyncgrpo.rollout.sequences import build_training_sequences  # noqa: E402
from asyncgrpo.rollout.tool_calls import parse_turn, tool_call_format  # noqa: E402
from asyncgrpo.rollout.training_templates import use_training_template  # noqa: E402
from asyncgrpo.rollout.types import TurnRecord  # noqa: E402

TEMPLATES = DATA / "chat_templates"
PROMPT = [
    {"role": "system", "content": "You multiply."},
    {"role": "user", "content": "What is 2 times 3?"},
]
ANSWER = "It is 6."


@dataclass(frozen=True)
class Family:
    template: str  # file under tests/data/chat_templates
    fmt: str
    special: tuple[str, ...]  # the family's tokens, special ones (dropped by skip_special_tokens)...
    markup: tuple[str, ...]  # ... and the others
    eos: str
    bos: str | None
    # What the model writes: a call of multiply(a=2, b=3), a malformed call, the answer; each ends with
    # the token the model stops on.
    replies: tuple[str, str, str]
    patched: bool = False  # the tool loop renders with a training template made from the family's own
    chat_template_kwargs: dict = field(default_factory=dict)

    def chat_template(self) -> str:
        return (TEMPLATES / self.template).read_text(encoding="utf-8")

    def tokenizer(self):
        chat = ChatTokens(self.chat_template(), self.special, self.markup, self.eos, self.eos, self.bos)
        tokenizer = build_tokenizer(tiny_vocabulary(), chat=chat)
        assert len(tokenizer) <= tiny_vocabulary(), "the server's model must know every id"
        return tokenizer


@functools.cache
def tiny_vocabulary() -> int:
    return len(build_tokenizer())


CHATML = ("<|im_start|>", "<|im_end|>")
HERMES_REPLIES = (
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 6,\n</tool_call><|im_end|>',
    ANSWER + "<|im_end|>",
)
DEEPSEEK_TOKENS = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
)
DEEPSEEK_TOKENS += ("<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>")
DEEPSEEK_TOKENS += ("<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")
GLM = Family(
    "glm_4_5.jinja",
    "glm45",
    ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
    + ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    ("<think>", "</think>", "<tool_response>", "</tool_response>"),
    "<|endoftext|>",
    None,
    (
        "\n<think>Multiply.</think>\n<tool_call>multiply\n<arg_key>a</arg_key>\n<arg_value>2</arg_value>\n"
        "<arg_key>b</arg_key>\n<arg_value>3</arg_value>\n</tool_call><|observation|>",
        "\n<think>Again.</think>\n<tool_call>multiply\n<arg_key>a</arg_key>\n</tool_call><|observation|>",
        f"\n<think>Done.</think>\n{ANSWER}<|user|>",
    ),
)
LLAMA = Family(
    "llama_3_1.jinja",
    "llama3_json",
    ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    + ("<|eom_id|>", "<|python_tag|>"),
    (),
    "<|eot_id|>",
    "<|begin_of_text|>",
    (
        '{"name": "multiply", "parameters": {"a": 2, "b": 3}}<|eot_id|>',
        '{"name": "multiply", "parameters": {"a": 6,<|eot_id|>',
        ANSWER + "<|eot_id|>",
    ),
)
MISTRAL_TOKENS = (
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
)
MISTRAL_TOKENS += ("[TOOL_RESULTS]", "[/TOOL_RESULTS]")
FAMILIES = {
    "qwen3": Family(
        "qwen3.jinja",
        "hermes",
        ("<|endoftext|>", *CHATML),
        ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"),
        "<|im_end|>",
        None,
        HERMES_REPLIES,
        patched=True,
        # Without thinking, Qwen3's generation prompt holds an empty think block that its own template
        # leaves out of the turn once it is history.
        chat_template_kwargs={"enable_thinking": False},
    ),
    "qwen2_5": Family(
        "qwen2_5.jinja",
        "hermes",
        ("<|endoftext|>", *CHATML),
        ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
        "<|im_end|>",
        None,
        HERMES_REPLIES,
    ),
    "hermes_3": Family(
        "hermes_3_tool_use.jinja",
        "hermes",
        ("<|begin_of_text|>", *CHATML, "<tool_call>", "</tool_call>"),
        ("<tool_response>", "</tool_response>"),
        "<|im_end|>",
        "<|begin_of_text|>",
        HERMES_REPLIES,
        patched=True,
    ),
    "deepseek_r1": Family(
        "deepseek_r1.jinja",
        "deepseek",
        ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", *DEEPSEEK_TOKENS),
        ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"),
        "<｜end▁of▁sentence｜>",
        "<｜begin▁of▁sentence｜>",
        (  # R1's generation prompt opens the reasoning; after tool outputs the model goes on directly
            "Multiply.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>multiply\n"
            '```json\n{"a": 2, "b": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>multiply\n"
            '```json\n{"a": 6,\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
            ANSWER + "<｜end▁of▁sentence｜>",
        ),
        patched=True,
    ),
    "glm_4_5": GLM,
    "glm_4_6": replace(GLM, template="glm_4_6.jinja"),
    "gpt_oss": Family(
        "gpt_oss.jinja",
        "harmony",
        ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>")
        + ("<|constrain|>", "<|call|>", "<|return|>"),
        (),
        "<|return|>",
        None,
        (
            "<|channel|>analysis<|message|>Multiply.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.multiply <|constrain|>json<|message|>{"a":2,"b":3}<|call|>',
            '<|channel|>commentary to=functions.multiply <|constrain|>json<|message|>{"a":6,<|call|>',
            f"<|channel|>final<|message|>{ANSWER}<|return|>",
        ),
        patched=True,
    ),
    "llama_3_1": LLAMA,
    "llama_3_2": replace(LLAMA, template="llama_3_2.jinja"),
    "mistral_nemo": Family(
        "mistral_nemo.jinja",
        "mistral",
        MISTRAL_TOKENS,
        (),
        "</s>",
        "<s>",
        (
            '[TOOL_CALLS][{"name": "multiply", "arguments": {"a": 2, "b": 3}, "id": "a1b2c3d4e"}]</s>',
            '[TOOL_CALLS][{"name": "multiply", "arguments": {"a": 6,}]</s>',
            ANSWER + "</s>",
        ),
        patched=True,
    ),
    "mistral_small_3_2": Family(
        "mistral_small_3_2.jinja",
        "mistral",
        MISTRAL_TOKENS + ("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[CALL_ID]", "[ARGS]", "[TOOL_CONTENT]"),
        (),
        "</s>",
        "<s>",
        (
            '[TOOL_CALLS]multiply[CALL_ID]a1b2c3d4e[ARGS]{"a": 2, "b": 3}</s>',
            '[TOOL_CALLS]multiply[ARGS]{"a": 6,</s>',
            ANSWER + "</s>",
        ),
        patched=True,
    ),
}
PATCHED = [name for name, family in FAMILIES.items() if family.patched]


def training_tokenizer(family: Family):
    """The family's tokenizer as a run with tools gets it (its training template, if it has one)."""
    tokenizer = family.tokenizer()
    assert use_training_template(tokenizer) == family.patched
    return tokenizer


class ListedTurnsLoop(ScriptedLoop):
    """The tool loop's turns written by the script, in order (no server)."""

    def __init__(self, tokenizer, family: Family):
        super().__init__(tokenizer, {}, chat_template_kwargs=family.chat_template_kwargs)
        self.turns_left = list(family.replies)

    def render_prompt(self, prompt, tools, group_id):
        return render_prompt_ids(self.tokenizer, prompt, tools, self.config.chat_template_kwargs)

    async def generate_one_turn(self, prompt_ids):
        ids = self.tokenizer.encode(self.turns_left.pop(0), add_special_tokens=False)
        return TurnRecord(prompt_ids=list(prompt_ids), output_ids=ids, output_log_probs=[-1.0] * len(ids))


def check_rollout(family: Family, loop, rollout) -> None:
    """The call ran, the malformed call was answered with an error and counted, the answer ended the
    rollout, and its three turns are one training sample: each turn's prompt starts with the tokens
    sampled so far, and each sampled token is trained once."""
    assert len(rollout.turns) == 3 and rollout.tool_call_count == 2 and rollout.tool_failure_count == 1
    first, product, _, error, last = rollout.completion
    assert first["tool_calls"] == [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 2, "b": 3}}}
    ]
    assert product == {"role": "tool", "name": "multiply", "content": "6"}
    assert error["content"].startswith("Error: ") and last["content"].endswith(ANSWER)
    record_tool_rollout_metrics(loop.metrics, rollout)
    assert loop.metrics.summarize()["tools/failure_frequency"] == pytest.approx(0.5)
    sequences, stats = build_training_sequences(rollout.turns)
    assert stats.forks == 0 and len(sequences) == 1
    assert_each_generated_token_trained_once(rollout.turns, sequences)


# -- the format, and the parser against the template's own rendering ----------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_the_call_format_is_read_from_the_real_template(name):
    family = FAMILIES[name]
    assert tool_call_format(family.chat_template()) == family.fmt
    assert tool_call_format(training_tokenizer(family).chat_template) == family.fmt


def test_a_family_whose_calls_are_not_read_declares_no_format():
    assert tool_call_format((TEMPLATES / "lfm2_5.jinja").read_text(encoding="utf-8")) is None
    assert tool_call_format(None) is None


def structured_calls(family: Family) -> list[dict]:
    """The calls an assistant message holds, as a chat template takes them: two where the family
    writes several per turn."""
    # DeepSeek's template concatenates the arguments as text.
    arguments = (
        ['{"a": 2, "b": 3}', '{"a": 4, "b": 5}']
        if family.fmt == "deepseek"
        else [{"a": 2, "b": 3}, {"a": 4, "b": 5}]
    )
    calls = [
        {"type": "function", "id": f"a1b2c3d4{index}", "function": {"name": "multiply", "arguments": value}}
        for index, value in enumerate(arguments)
    ]
    return calls[:1] if family.fmt in ("llama3_json", "harmony") else calls  # one call a message


@pytest.mark.parametrize("name", FAMILIES)
def test_the_parser_reads_the_calls_the_template_renders(name):
    # The format the model was trained on is the one its template renders for a structured call: that
    # text, tokenized and decoded as a sampled turn is, must read back as the same calls.
    family = FAMILIES[name]
    tokenizer = family.tokenizer()
    calls = structured_calls(family)
    conversation = [*PROMPT, {"role": "assistant", "content": "", "tool_calls": calls}]
    tools = [tool_schema(multiply)]
    prompt = tokenizer.apply_chat_template(
        conversation[:-1], tools=tools, add_generation_prompt=True, tokenize=False
    )
    whole = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False)
    prompt_ids, whole_ids = (tokenizer.encode(text, add_special_tokens=False) for text in (prompt, whole))
    text = turn_text(tokenizer, whole_ids[len(os.path.commonprefix([prompt_ids, whole_ids])) :], family.fmt)
    parsed = parse_turn(text, family.fmt, with_tools=True, reasoning=False)
    type_text_arguments(parsed.calls, [multiply])
    assert [(call.name, call.arguments, call.error) for call in parsed.calls] == [
        ("multiply", {"a": 2, "b": 3}, None),
        ("multiply", {"a": 4, "b": 5}, None),
    ][: len(calls)], text


@pytest.mark.parametrize("name", FAMILIES)
def test_the_parser_reads_what_the_model_writes(name):
    family = FAMILIES[name]
    tokenizer = family.tokenizer()
    texts = [
        turn_text(tokenizer, tokenizer.encode(reply, add_special_tokens=False), family.fmt)
        for reply in family.replies
    ]
    call, malformed, answer = (
        parse_turn(text, family.fmt, with_tools=True, reasoning=True) for text in texts
    )
    type_text_arguments(call.calls, [multiply])
    assert [(c.name, c.arguments, c.error) for c in call.calls] == [("multiply", {"a": 2, "b": 3}, None)]
    assert len(malformed.calls) == 1 and malformed.calls[0].error
    assert answer.calls == [] and answer.content == ANSWER
    if family.fmt in ("deepseek", "glm45", "harmony"):  # the families that reason before the call
        assert call.reasoning == "Multiply." and call.content == ""


# -- the multi-turn rollout ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_a_rollout_re_renders_each_turn_as_it_was_sampled(name):
    family = FAMILIES[name]
    loop = ListedTurnsLoop(training_tokenizer(family), family)
    rollout = asyncio.run(run_tool_loop(loop, PROMPT, [multiply], 0))
    check_rollout(family, loop, rollout)


@pytest.mark.parametrize("name", PATCHED)
def test_the_families_own_template_would_fork_or_refuse_the_rollout(name):
    # Why these families get a training template: with their own, the same rollout forks (Qwen3 drops
    # earlier reasoning, Hermes 3 renders a tool result differently once it is not last, DeepSeek-R1
    # drops the reasoning its generation prompt opened) or cannot be rendered (gpt-oss refuses channel
    # tags in content, Mistral refuses an assistant turn after a tool result).
    family = FAMILIES[name]
    loop = ListedTurnsLoop(family.tokenizer(), family)
    try:
        rollout = asyncio.run(run_tool_loop(loop, PROMPT, [multiply], 0))
    except TemplateError:
        assert family.fmt in ("harmony", "mistral")
        return
    _, stats = build_training_sequences(rollout.turns)
    assert stats.forks > 0


def test_a_loop_that_meets_an_unreadable_template_refuses_it():
    # The trainer refuses it at start (below); a custom loop reaching the tool loop anyway fails at its
    # first rollout rather than running single-turn rollouts.
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (TEMPLATES / "lfm2_5.jinja").read_text(encoding="utf-8")
    loop = ListedTurnsLoop(tokenizer, FAMILIES["qwen3"])
    with pytest.raises(ValueError, match="Supported formats: hermes"):
        asyncio.run(run_tool_loop(loop, PROMPT, [multiply], 0))


def test_a_template_whose_calls_cannot_be_read_is_refused_when_the_trainer_is_built(tiny_model_dir, tmp_path):
    pytest.importorskip("datasets", reason="datasets is not installed")
    from datasets import Dataset

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = (TEMPLATES / "lfm2_5.jinja").read_text(encoding="utf-8")
    dataset = Dataset.from_dict({"prompt": [PROMPT[1:]] * 4})
    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", max_steps=1)
    build = functools.partial(
        AsyncGRPOTrainer, str(tiny_model_dir), lambda completions, **kwargs: [0.0], args, dataset
    )
    with pytest.raises(ValueError, match="teaches no tool-call format") as refused:
        build(processing_class=tokenizer, tools=[multiply])
    for fmt in ("hermes", "xml", "glm45", "deepseek", "harmony", "mistral", "llama3_json"):
        assert fmt in str(refused.value)
    build(processing_class=tokenizer)  # without tools no call is read: the template is fine


# -- against the real server --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ForcedToken(SamplingParams):
    """One token that the server must sample: the only one it is allowed."""

    token: int = 0

    def as_request_fields(self):
        return {**super().as_request_fields(), "allowed_token_ids": [self.token]}


class ForcedTurnsLoop(ListedTurnsLoop):
    """The tool loop's turns sampled by the real vLLM server, token by token, each request allowed only
    the script's next token (the tiny random model writes no calls of its own)."""

    def __init__(self, tokenizer, family: Family, client: VLLMClient, max_model_len: int):
        super().__init__(tokenizer, family)
        self.client = client
        self.max_model_len = max_model_len

    async def generate_one_turn(self, prompt_ids):
        output_ids, log_probs = [], []
        for token in self.tokenizer.encode(self.turns_left.pop(0), add_special_tokens=False):
            sampled = await self.client.generate_tokens(
                list(prompt_ids) + output_ids, ForcedToken(max_tokens=1, token=token), seed=0
            )
            output_ids += sampled.token_ids.tolist()
            log_probs += sampled.logprobs.tolist()
        assert len(prompt_ids) + len(output_ids) < self.max_model_len
        return TurnRecord(prompt_ids=list(prompt_ids), output_ids=output_ids, output_log_probs=log_probs)


@pytest.fixture(scope="module")
def server_rollouts(vllm_server):
    """Every family's rollout against the shared server, side by side (the server batches them)."""
    from conftest import MAX_MODEL_LEN

    async def all_families():
        async with VLLMClient(vllm_server.url, timeout=60) as client:
            loops = {
                name: ForcedTurnsLoop(training_tokenizer(family), family, client, MAX_MODEL_LEN)
                for name, family in FAMILIES.items()
            }
            rollouts = await asyncio.gather(
                *(run_tool_loop(loop, PROMPT, [multiply], 0) for loop in loops.values())
            )
        return {name: (loops[name], rollout) for name, rollout in zip(loops, rollouts)}

    started = time.monotonic()
    rollouts = asyncio.run(all_families())
    print(f"{len(FAMILIES)} families' rollouts against the server: {time.monotonic() - started:.1f} s")
    return rollouts


@pytest.mark.vllm
@pytest.mark.parametrize("name", FAMILIES)
def test_a_multi_turn_rollout_of_each_family_against_the_server(server_rollouts, name):
    loop, rollout = server_rollouts[name]
    check_rollout(FAMILIES[name], loop, rollout)
    # The server sampled the forced tokens (log-probability 0: the only token allowed).
    assert all(logprob == 0.0 for turn in rollout.turns for logprob in turn.output_log_probs)
