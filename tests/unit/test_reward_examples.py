"""TRL's documented reward-function examples (tests/support/reward_examples.py) give the values the
documentation shows, and examples/functions.py's copies of examples 2 and 3 agree with them."""

from __future__ import annotations

import asyncio

import pytest
from reward_examples import (
    MULTI_TASK_DATASET,
    async_reward_func,
    boxed_reward_func,
    coding_reward_func,
    format_reward_func,
    length_reward_func,
    math_reward_func,
)


def assistant(*contents: str) -> list[list[dict[str, str]]]:
    return [[{"role": "assistant", "content": content}] for content in contents]


# The documentation's own inputs, quoted.
FORMAT_PROMPTS = [
    [{"role": "user", "content": "What is the result of (1 + 2) * 4?"}],
    [{"role": "user", "content": "What is the result of (3 + 1) * 2?"}],
]
FORMAT_COMPLETIONS = assistant(
    "<think>The sum of 1 and 2 is 3, which we multiply by 4 to get 12.</think>"
    "<answer>(1 + 2) * 4 = 12</answer>",
    "The sum of 3 and 1 is 4, which we multiply by 2 to get 8. So (3 + 1) * 2 = 8.",
)
BOXED_PROMPTS = [
    [{"role": "user", "content": "Solve the equation $2x + 3 = 7$."}],
    [{"role": "user", "content": "Solve the equation $3x - 5 = 10$."}],
]
BOXED_COMPLETIONS = assistant(r"The solution is \boxed{2}.", r"The solution is \boxed{6}.")


def test_example_1_longer_completions_score_higher():
    prompts = [[{"role": "user", "content": "The sky is"}], [{"role": "user", "content": "The sun is"}]]
    completions = assistant(" blue.", " in the sky.")
    completion_ids = [[6303, 13], [304, 279, 12884, 13]]
    assert length_reward_func(prompts=prompts, completions=completions, completion_ids=completion_ids) == [
        2.0,
        4.0,
    ]


def test_example_2_format():
    assert format_reward_func(prompts=FORMAT_PROMPTS, completions=FORMAT_COMPLETIONS) == [1.0, 0.0]


def test_example_3_boxed_answer_against_ground_truth():
    rewards = boxed_reward_func(prompts=BOXED_PROMPTS, completions=BOXED_COMPLETIONS, ground_truth=["2", "5"])
    assert rewards == [1.0, 0.0]


def test_example_4_each_task_scored_by_its_own_function():
    prompts = [row["prompt"] for row in MULTI_TASK_DATASET]
    task = [row["task"] for row in MULTI_TASK_DATASET]
    completions = assistant(
        "2 + 2 = 4",
        "```python\ndef add(a, b):\n    return a + b\n```",
        "3 * 4 = 13",  # wrong
        "```python\ndef multiply(a, b):\n    return a + b\n```",  # wrong
    )
    assert math_reward_func(prompts, completions, task) == [1.0, None, -1.0, None]
    assert coding_reward_func(prompts, completions, task) == [None, 1.0, None, -1.0]


def test_example_5_async():
    rewards = asyncio.run(async_reward_func(prompts=FORMAT_PROMPTS, completions=FORMAT_COMPLETIONS))
    assert rewards == [1.0, 1.0]
    assert asyncio.run(async_reward_func(prompts=[[]], completions=[[]])) == [0.0]


def test_the_example_configs_copies_give_the_documented_values():
    pytest.importorskip(
        "msgspec", reason="examples/functions.py imports the rollout loop, which needs msgspec"
    )
    from examples import functions

    assert functions.format_reward_func(prompts=FORMAT_PROMPTS, completions=FORMAT_COMPLETIONS) == [1.0, 0.0]
    assert functions.boxed_reward_func(
        prompts=BOXED_PROMPTS, completions=BOXED_COMPLETIONS, ground_truth=["2", "5"]
    ) == [1.0, 0.0]
