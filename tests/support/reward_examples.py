"""TRL's documented custom reward functions (examples 1 to 5 of "Using a custom reward function"),
written once for every test that uses them. Module level: the rollout worker is a spawned process that
imports each reward function by name.

The documentation calls both example 1 and example 3 `reward_func`; here they are
`length_reward_func` and `boxed_reward_func`. Example 4 calls `check_math_solution` and
`test_code_solution`, which the documentation leaves to the reader: the versions here check the
arithmetic the prompt asks and run the code the completion gives. Examples 2 and 3 are also in
examples/functions.py, which the example config examples/reference_answers.yaml runs (that module
imports the rollout loop, which pure tests do without).
"""

from __future__ import annotations

import asyncio
import re


# Example 1: rewarding longer completions.
def length_reward_func(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]


# Example 2: rewarding completions of a given format.
def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


# Example 3: rewarding completions against a reference (a `ground_truth` column).
def boxed_reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion[0]["content"]) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


# Example 4: multi-task reward functions, on this dataset (a `task` column routes each row).
MULTI_TASK_DATASET = [
    {"prompt": [{"role": "user", "content": "What is 2+2?"}], "task": "math"},
    {
        "prompt": [{"role": "user", "content": "Write a function that returns the sum of two numbers."}],
        "task": "code",
    },
    {"prompt": [{"role": "user", "content": "What is 3*4?"}], "task": "math"},
    {
        "prompt": [{"role": "user", "content": "Write a function that returns the product of two numbers."}],
        "task": "code",
    },
]


def check_math_solution(prompt, completion) -> bool:
    """The completion's last number is the value of the arithmetic the prompt asks about."""
    question = re.search(r"What is ([0-9+\-*/ ()]+)\?", prompt[-1]["content"])
    numbers = re.findall(r"-?\d+", completion[-1]["content"])
    if question is None or not numbers:
        return False
    return int(numbers[-1]) == eval(question.group(1))  # noqa: S307 -- digits and operators only


def test_code_solution(prompt, completion) -> bool:
    """The completion's last Python code block defines a function of two numbers that returns the sum
    (or the product) the prompt asks for."""
    blocks = re.findall(r"```(?:python)?\n(.*?)```", completion[-1]["content"], re.DOTALL)
    if not blocks:
        return False
    namespace: dict = {}
    try:
        exec(blocks[-1], namespace)  # noqa: S102 -- a test's toy check: sandbox untrusted code
        function = next(value for name, value in namespace.items() if callable(value) and name[0] != "_")
        return function(2, 3) == (5 if "sum" in prompt[-1]["content"] else 6)
    except Exception:  # noqa: BLE001 -- any failure of the completion's code fails the check
        return False


# Math-specific reward function
def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            # Calculate math-specific reward
            correct = check_math_solution(prompt, completion)
            reward = 1.0 if correct else -1.0
            rewards.append(reward)
        else:
            # Return None for non-math tasks
            rewards.append(None)
    return rewards


# Coding-specific reward function
def coding_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "code":
            # Calculate coding-specific reward
            works = test_code_solution(prompt, completion)
            reward = 1.0 if works else -1.0
            rewards.append(reward)
        else:
            # Return None for non-coding tasks
            rewards.append(None)
    return rewards


# Example 5: an asynchronous reward function.
async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]
