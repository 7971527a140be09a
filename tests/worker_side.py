"""What the integration tests hand the rollout worker: reward functions, a rollout loop and its config.

The worker is a spawned process, and it imports the module that defines each object it is sent. A test
module imports the trainer (transformers' Trainer, accelerate and more): seconds added to every worker's
start, on the way to the run's first step. Defined here, they cost the worker no more than it imports
anyway (the config, the rollout loop, datasets). The test modules import them from here.
"""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass

import numpy as np
from datasets import Dataset

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.rollout.loop import AsyncRolloutLoop


def token_parity_reward(completion_ids, **kwargs):
    return [sum(1 for token in ids if token % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def prompts(n: int = 40) -> Dataset:
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"Say something about {i}."}] for i in range(n)]}
    )


# -- TRL's documented CurriculumRolloutLoop and its config subclass (tests/test_trainer_e2e.py) -----------


@dataclass
class CurriculumConfig(AsyncGRPOConfig):
    pass_rate_cap: float = 0.9


class CurriculumRolloutLoop(AsyncRolloutLoop):
    def filter_prompt(self, row_index, row, epoch):
        return self.pass_rates.get(row_index, 0.0) < self.config.pass_rate_cap

    async def setup(self):
        self.pass_rates = {}

    def compute_advantages(self, group):
        scored = group.rewards[~np.isnan(group.rewards)]
        if len(scored):
            self.pass_rates[group.row_index] = float(np.mean(scored > 0))
        return super().compute_advantages(group)


def positive_if_even_start(completion_ids, **kwargs):
    return [1.0 if ids and ids[0] % 2 == 0 else 0.0 for ids in completion_ids]


# -- the evaluation tests' rewards (tests/test_evaluation.py) ----------------------------------------------


def first_token_reward(completion_ids, split, **kwargs):
    """The first generated token's id: with greedy decoding, a function of the weights alone. Raises in
    the rollout worker (a child process) if an eval prompt ever reaches it."""
    if multiprocessing.parent_process() is not None and "eval" in split:
        raise AssertionError("an eval prompt reached the rollout worker")
    return [float(ids[0]) if ids else 0.0 for ids in completion_ids]


def listed_passes(completions, passes, **kwargs):
    """1.0 for the first `passes` rollouts of a prompt, 0.0 for the rest: a known count per prompt."""
    return [1.0 if index < passes[0] else 0.0 for index in range(len(completions))]
