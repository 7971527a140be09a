"""Python used by the example configs, named there by import path (`examples.functions:NAME`).

Run `asyncgrpo train` from the repository root so that `examples` imports. Everything here is at
module level: the rollout worker is a separate process that imports it by name.
"""

from __future__ import annotations

import asyncio
import random
import re

import numpy as np

from asyncgrpo.rewards import accuracy_reward
from asyncgrpo.rollout.loop import AsyncRolloutLoop


def math_reward_func(prompts, completions, task, solution, **kwargs):
    """accuracy_reward for math rows, None (not scored here) for the others."""
    scores = accuracy_reward(completions, solution=solution)
    return [score if kind == "math" else None for score, kind in zip(scores, task)]


def coding_reward_func(prompts, completions, task, solution, **kwargs):
    """1 when the code block defines what the row's assertion tests, -1 when it fails, None for other
    tasks."""
    rewards = []
    for completion, kind, check in zip(completions, task, solution):
        if kind != "coding":
            rewards.append(None)
            continue
        match = re.search(r"```(?:python)?\n(.*?)```", completion[0]["content"], re.DOTALL)
        rewards.append(1.0 if match and _passes(match.group(1), check) else -1.0)
    return rewards


def _passes(code: str, check: str) -> bool:
    namespace: dict = {}
    try:
        exec(code + "\n" + check, namespace)  # noqa: S102 -- an example only: sandbox untrusted code
    except Exception:  # noqa: BLE001 -- any failure of the model's code scores it as failing
        return False
    return True


async def async_reward_func(prompts, completions, **kwargs):
    """Stands for a slow remote judge: 1 for a non-empty completion."""
    await asyncio.sleep(0.01)
    return [1.0 if completion[0]["content"] else 0.0 for completion in completions]


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


class IncrementEnv:
    """Samples a target in reset(); the model reaches it with the `increment` tool."""

    def reset(self, **kwargs) -> str:
        self.counter = 0
        self.target = random.randint(1, 6)
        return f"Increment the counter by {self.target}."

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


class CurriculumRolloutLoop(AsyncRolloutLoop):
    """Stops sampling the prompts whose groups already pass at least PASS_RATE_CAP of the time."""

    PASS_RATE_CAP = 0.9

    async def setup(self):
        self.pass_rates = {}

    def filter_prompt(self, row_index, row, epoch):
        return self.pass_rates.get(row_index, 0.0) < self.PASS_RATE_CAP

    def compute_advantages(self, group):
        scored = group.rewards[~np.isnan(group.rewards)]
        if len(scored):
            self.pass_rates[group.row_index] = float(np.mean(scored > 0))
        return super().compute_advantages(group)
