"""Multi-turn rollouts turned into training sequences, with the real tiny tokenizer and templates: a
template that keeps the history extends one sample, one that rewrites it forks and still trains each
generated token once, the reconciliation metrics by hand, the warning for an unknown template that
rewrites history, and the Qwen3 training template put in place of Qwen3's own."""

from __future__ import annotations

import logging

import pytest
from agent_fakes import QWEN3_5_LIKE, assert_each_generated_token_trained_once, call, multiply

from asyncgrpo.cli.tiny_model import build_tokenizer
from asyncgrpo.records.metrics import MetricsWindow
from asyncgrpo.rollout.chat import RewriteDetector, render_prompt_ids
from asyncgrpo.rollout.rollout_metrics import record_rollout_metrics
from asyncgrpo.rollout.sequences import build_training_sequences
from asyncgrpo.rollout.training_templates import QWEN3_TRAINING_TEMPLATE, use_training_template
from asyncgrpo.rollout.types import Rollout, TurnRecord

# A Qwen3-style template: earlier assistant turns lose their <think> block once a later user turn exists.
REWRITING_TEMPLATE = QWEN3_TRAINING_TEMPLATE.replace(
    "{%- set content = message.content if message.content is string else '' %}",
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if not loop.last and '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}",
).replace("last_query_index", "")


def conversation_turns(tokenizer, replies: list[str], tools=(multiply,)):
    """Turns as the tool loop builds them: render, sample (the scripted reply), append, run tools."""
    conversation = [{"role": "user", "content": "start"}]
    turns = []
    for reply in replies:
        prompt_ids = render_prompt_ids(tokenizer, conversation, list(tools))
        output = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        turns.append(
            TurnRecord(prompt_ids=prompt_ids, output_ids=output, output_log_probs=[-1.0] * len(output))
        )
        conversation += [
            {"role": "assistant", "content": reply},
            {"role": "tool", "name": "multiply", "content": "6"},
        ]
    return turns


def test_prefix_preserving_template_extends_one_sample(tokenizer):
    turns = conversation_turns(tokenizer, ["<think>a</think>" + call("multiply", a=2, b=3)] * 2 + ["six"])
    sequences, stats = build_training_sequences(turns)
    assert len(sequences) == 1 and stats.transitions == 2 and stats.forks == 0
    assert_each_generated_token_trained_once(turns, sequences)


def test_a_history_rewriting_template_forks_and_still_trains_each_token_once(tokenizer):
    rewriting = build_tokenizer()
    rewriting.chat_template = REWRITING_TEMPLATE
    turns = conversation_turns(rewriting, ["<think>a</think>" + call("multiply", a=2, b=3)] * 2 + ["six"])
    sequences, stats = build_training_sequences(turns)
    assert stats.transitions == 2 and stats.forks == 2 and len(sequences) == 3
    assert all(drift > 0 for drift in stats.drift_tokens)
    assert_each_generated_token_trained_once(turns, sequences)


def test_a_fork_then_an_extension_trains_each_token_once():
    # Turn 2 re-renders turn 1's output differently (a fork); turn 3 extends turn 2's sample.
    turns = [
        TurnRecord(prompt_ids=[1, 2], output_ids=[3, 4], output_log_probs=[-0.1, -0.2]),
        TurnRecord(prompt_ids=[1, 2, 30, 4, 9], output_ids=[5], output_log_probs=[-0.3]),
        TurnRecord(prompt_ids=[1, 2, 30, 4, 9, 5, 8], output_ids=[6, 7], output_log_probs=[-0.4, -0.5]),
    ]
    sequences, stats = build_training_sequences(turns)
    assert [s.token_ids.tolist() for s in sequences] == [[1, 2, 3, 4], [1, 2, 30, 4, 9, 5, 8, 6, 7]]
    assert [s.trained.astype(int).tolist() for s in sequences] == [
        [0, 0, 1, 1],
        [0, 0, 0, 0, 0, 1, 0, 1, 1],
    ]
    assert [s.sampler_logprobs.tolist() for s in sequences] == [
        pytest.approx([-0.1, -0.2]),
        pytest.approx([-0.3, -0.4, -0.5]),
    ]
    assert stats.transitions == 2 and stats.forks == 1 and stats.drift_tokens == [2, 0]
    assert_each_generated_token_trained_once(turns, sequences)
    # The rollout's reconciliation metrics, by hand: 1 fork in 2 transitions, drifts 2 and 0,
    # 2 samples, 3 turns.
    window = MetricsWindow()
    rollout = Rollout(completion=[], completion_ids=[], turns=turns)
    record_rollout_metrics(window, rollout, 1.0, len(sequences), stats, eos_token_ids=[7])
    summary = window.summarize()
    assert summary["rollout/fork_frac"] == 0.5 and summary["rollout/samples_per_rollout"] == 2
    assert summary["rollout/drift_tokens_mean"] == 1.0 and summary["rollout/drift_tokens_max"] == 2
    assert summary["rollout/turns_mean"] == 3 and summary["rollout/turns_max"] == 3


def test_an_unknown_template_that_rewrites_history_is_reported_once(caplog):
    detector = RewriteDetector()
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.rollout.chat"):
        detector.observe(transitions=2, forks=0)
        assert not caplog.records, "no fork, no warning"
        detector.observe(transitions=2, forks=2)
        detector.observe(transitions=3, forks=1)
    assert len(caplog.records) == 1 and "rollout/fork_frac" in caplog.records[0].getMessage()


def test_known_qwen3_template_is_replaced_by_the_training_template():
    qwen3 = build_tokenizer()
    qwen3.chat_template = "{%- set last_query_index = 0 %}<tool_call>{{ reasoning_content }}"
    assert use_training_template(qwen3) and qwen3.chat_template == QWEN3_TRAINING_TEMPLATE
    other = build_tokenizer()
    assert not use_training_template(other)
    # Qwen3.5 also drops earlier reasoning, but its calls are <function=...> blocks: the Qwen3
    # training template would teach it another format, so its own template stays.
    qwen3_5 = build_tokenizer()
    qwen3_5.chat_template = QWEN3_5_LIKE
    assert not use_training_template(qwen3_5) and qwen3_5.chat_template == QWEN3_5_LIKE
