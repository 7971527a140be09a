"""Tool calls read from a model's turn, without a server: the Hermes, Mistral, Qwen3.5 XML and Llama 3
formats on hand-written turns (every family with its real chat template: tests/integration/test_chat_families.py),
which format a chat template declares, and reasoning split from content; the other way, the tool
schemas built from Python functions and the tools rendered into the prompt by the tiny tokenizer's
template."""

from __future__ import annotations

from agent_fakes import LLAMA3_LIKE, MISTRAL_LIKE, QWEN3_5_LIKE, Counter, multiply

from asyncgrpo.rollout.chat import render_prompt_ids, tool_schema
from asyncgrpo.rollout.tool_calls import parse_tool_calls, parse_turn, split_reasoning, tool_call_format
from asyncgrpo.rollout.training_templates import QWEN3_TRAINING_TEMPLATE

# -- parsing -----------------------------------------------------------------------------------------------


def test_hermes_calls_are_read_in_order_and_removed_from_content():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>{"name": "neg", "arguments": "{\\"x\\": 3}"}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me add."
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("add", {"a": 1, "b": 2}, None),
        ("neg", {"x": 3}, None),
    ]


def test_malformed_calls_are_kept_with_a_reason():
    _, calls = parse_tool_calls(
        '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call><tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call><tool_call>{"name": "cut"'
    )
    assert [c.name for c in calls] == [None, None, "f", None]
    assert all(c.error for c in calls)
    assert "not valid JSON" in calls[0].error and '"name"' in calls[1].error and "object" in calls[2].error


def test_mistral_format():
    content, calls = parse_tool_calls('ok[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]', "mistral")
    assert content == "ok" and calls[0].name == "add" and calls[0].arguments == {"a": 1}


def test_xml_format_of_qwen3_5_is_read_in_order():
    text = (
        "I will call.\n\n<tool_call>\n<function=multiply>\n<parameter=a>\n2\n</parameter>\n"
        "<parameter=b>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=greet>\n"
        "<parameter=name>\nAda\nLovelace\n</parameter>\n</function>\n</tool_call>"
        "<tool_call>\n<parameter=x>\n1\n</parameter>\n</tool_call>"
    )
    content, calls = parse_tool_calls(text, "xml")
    assert content == "I will call."
    assert [(c.name, c.arguments, c.text_arguments) for c in calls[:2]] == [
        ("multiply", {"a": "2", "b": "3"}, True),
        ("greet", {"name": "Ada\nLovelace"}, True),
    ]
    assert calls[2].name is None and "<function=NAME>" in calls[2].error


def test_deepseek_v3_1_writes_the_name_before_the_separator_and_no_fence():
    # DeepSeek-V3.1's form (V3/R1's fenced form is read with R1's real template in test_chat_families).
    text = (
        'Let me.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>multiply<｜tool▁sep｜>{"a": 2, "b": 3}<｜tool▁call▁end｜>'
        '<｜tool▁call▁begin｜>multiply<｜tool▁sep｜>{"a": 4,<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    content, (good, broken) = parse_tool_calls(text, "deepseek")
    assert content == "Let me." and (good.name, good.arguments) == ("multiply", {"a": 2, "b": 3})
    assert broken.name == "multiply" and "not valid JSON" in broken.error


def test_llama3_json_format_is_one_bare_object():
    content, calls = parse_tool_calls(' {"name": "add", "parameters": {"a": 1}}', "llama3_json")
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("add", {"a": 1})]
    assert parse_tool_calls("The answer is {a}.", "llama3_json") == ("The answer is {a}.", [])
    _, (broken,) = parse_tool_calls('{"name": "add", "parameters": {"a": ', "llama3_json")
    assert broken.name is None and "not valid JSON" in broken.error


def test_call_format_is_the_one_the_template_declares():
    assert tool_call_format(QWEN3_TRAINING_TEMPLATE) == "hermes"
    assert tool_call_format(QWEN3_5_LIKE) == "xml"
    assert tool_call_format(MISTRAL_LIKE) == "mistral"
    assert tool_call_format(LLAMA3_LIKE) == "llama3_json"
    assert tool_call_format(None) is None  # no template, no format: a run with tools refuses it


def test_reasoning_is_split_like_parse_response():
    assert split_reasoning("<think>\nhmm\n</think>\n\n42") == ("hmm", "42")
    assert split_reasoning("hmm</think>42") == ("hmm", "42")  # opening tag in the generation prompt
    assert split_reasoning("<think>cut off") == (None, "<think>cut off")
    parsed = parse_turn(
        '<think>a</think><tool_call>{"name": "f", "arguments": {}}</tool_call>', "hermes", True, True
    )
    assert parsed.reasoning == "a" and parsed.content == "" and parsed.calls[0].name == "f"
    kept = parse_turn("<think>a</think>b", "hermes", False, reasoning=False)
    assert kept.reasoning is None and kept.content == "<think>a</think>b"


# -- schemas and rendering ---------------------------------------------------------------------------------


def undocumented(step: int, label: str = "x") -> str:
    return label * step


def test_schemas_from_docstrings_with_a_plain_fallback():
    schema = tool_schema(multiply)["function"]
    assert schema["name"] == "multiply" and schema["description"] == "Multiplies two integers."
    assert schema["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first integer."}
    plain = tool_schema(undocumented)["function"]
    assert plain["parameters"] == {
        "type": "object",
        "properties": {"step": {"type": "integer"}, "label": {"type": "string"}},
        "required": ["step"],
    }
    bound = tool_schema(Counter().increment)["function"]
    assert bound["name"] == "increment" and list(bound["parameters"]["properties"]) == ["step"]


def test_render_prompt_ids_offers_the_tools(tokenizer):
    ids = render_prompt_ids(tokenizer, [{"role": "user", "content": "hi"}], [multiply])
    text = tokenizer.decode(ids)
    assert '"name": "multiply"' in text and text.endswith("<|im_start|>assistant\n")
    assert render_prompt_ids(tokenizer, [{"role": "user", "content": "hi"}]) == list(
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)[
            "input_ids"
        ]
    )
