"""accuracy_reward on a small shipped sample of math problems and completions, right and wrong."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from asyncgrpo.rewards import accuracy_reward

SAMPLE = [json.loads(line) for line in (Path(__file__).parent / "data" / "math_completions.jsonl").read_text().splitlines()]


def as_completions(texts):
    return [[{"role": "assistant", "content": text}] for text in texts]


def test_accuracy_reward_on_the_shipped_sample():
    rewards = accuracy_reward(
        completions=as_completions([row["completion"] for row in SAMPLE]),
        solution=[row["solution"] for row in SAMPLE],
        prompts=[[{"role": "user", "content": row["problem"]}] for row in SAMPLE],
    )
    wrong = [(row["problem"], row["completion"], got) for row, got in zip(SAMPLE, rewards) if got != row["expected"]]
    assert not wrong
    assert {0.0, 1.0} <= set(rewards), "the sample holds right and wrong answers"


def test_accuracy_reward_works_in_a_worker_thread():
    """Reward functions run in the worker's threads, where signal-based timeouts cannot work."""
    results = []
    thread = threading.Thread(
        target=lambda: results.append(accuracy_reward(as_completions(["\\boxed{\\frac{2}{4}}"]), solution=["0.5"]))
    )
    thread.start()
    thread.join(timeout=30)
    assert results == [[1.0]]


def test_an_unparsable_reference_scores_none():
    assert accuracy_reward(as_completions(["\\boxed{1}"]), solution=["$$"]) == [None]
