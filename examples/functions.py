"""Python used by the example configs, named there by import path (`examples.functions:NAME`).

Run `asyncgrpo train` from the repository root so that `examples` imports. Everything here is at
module level: the rollout worker is a separate process that imports it by name.
"""

from __future__ import annotations

import asyncio
import random
import re
import subprocess
import sys

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
        # The last code block is the answer: the reasoning before it (in content by default) may hold drafts.
        blocks = re.findall(r"```(?:python)?\n(.*?)```", completion[0]["content"], re.DOTALL)
        rewards.append(1.0 if blocks and _passes(blocks[-1], check) else -1.0)
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


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def boxed_reward_func(completions, ground_truth, **kwargs):
    """1.0 when the `\\boxed{}` answer is the row's `ground_truth` column, as text; 0.0 otherwise."""
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion[0]["content"]) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


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


class TargetIncrementEnv:
    """IncrementEnv with the task in the dataset: the row's `target` column reaches reset()."""

    def reset(self, target, **kwargs) -> None:
        self.counter = 0
        self.target = target

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


def format_reward(completions, **kwargs):
    """Trainer-owned reward beside an environment's own: 1 when the last turn is a short plain answer."""
    return [1.0 if 0 < len(completion[-1]["content"]) <= 200 else 0.0 for completion in completions]


class CodingEnv:
    """Asks for a Fibonacci number; the model runs code with `run_code` and scores by its last output."""

    def reset(self, **kwargs) -> str:
        self.n = random.randint(1, 20)
        self.last_output = ""
        return f"Compute the {self.n}th Fibonacci number."

    def get_reward(self) -> float:
        a, b = 0, 1
        for _ in range(self.n):
            a, b = b, a + b
        return float(self.last_output.strip().endswith(str(a)))

    def run_code(self, code: str) -> str:
        """Run the given Python code and return its stdout.

        Args:
            code: The Python source to execute.

        Returns:
            The captured standard output.
        """
        # An example only: run untrusted code in a sandbox. A separate interpreter with a time limit
        # keeps a looping program from holding the rollout.
        try:
            result = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, timeout=5, check=False
            )
        except subprocess.TimeoutExpired:
            return "timed out after 5 s"
        self.last_output = result.stdout
        return (result.stdout + result.stderr)[-2000:]


class GameEnv:
    """A 4x4 grid: the player starts at (0, 0) and must reach the goal tile at (3, 3)."""

    MOVES = {"up": (0, -1), "down": (0, 1), "left": (-1, 0), "right": (1, 0)}

    def reset(self, **kwargs) -> str:
        self.position = (0, 0)
        return "Reach the goal tile."

    def get_reward(self) -> float:
        return float(self.position == (3, 3))

    def move(self, action: str) -> str:
        """Apply an action to the game and return the new observation.

        Args:
            action: One of "up", "down", "left", "right".

        Returns:
            The observation after the move.
        """
        if action not in self.MOVES:
            return f"unknown action {action!r}: use up, down, left or right"
        dx, dy = self.MOVES[action]
        self.position = (min(3, max(0, self.position[0] + dx)), min(3, max(0, self.position[1] + dy)))
        return (
            "goal reached" if self.position == (3, 3) else f"you are at {self.position}, the goal at (3, 3)"
        )
