"""Environments without a server: which of their methods become tools, the pool of instances (reused
across episodes, never shared by two at once, chosen by the `environment` column), a dataset-backed
environment reading its task from the row, the prompt built from reset()'s observation, one reward
source per environment class, and the checks of agent inputs at construction."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from agent_fakes import Counter, multiply

from asyncgrpo.records.metrics import MetricsWindow
from asyncgrpo.rollout.environments import (
    EnvironmentPool,
    environment_reward_sources,
    environment_tools,
    prompt_with_observation,
)


def test_environment_tools_are_public_methods_only():
    assert [tool.__name__ for tool in environment_tools(Counter())] == ["increment"]


class Slot:
    created = 0

    def __init__(self):
        Slot.created += 1

    def reset(self, task: str, **kwargs) -> str:
        self.task = task
        self.columns = kwargs
        return f"Do {task}."

    async def get_reward(self) -> float:
        return 1.0


def test_environment_pool_reuses_instances_and_drops_the_routing_column():
    window = MetricsWindow()
    Slot.created = 0

    async def episodes():
        pool = EnvironmentPool({"slot": Slot}, ThreadPoolExecutor(2), lambda: window)
        row = {"environment": "slot", "task": "x", "extra": 1}
        rewards = []
        for _ in range(3):
            async with pool.episode(row) as episode:
                assert episode.prompt == [{"role": "user", "content": "Do x."}]
                assert episode.instance.columns == {"extra": 1}
                rewards.append(await pool.reward(episode.instance))
        with pytest.raises(ValueError, match="routes to environment 'game'"):
            async with pool.episode({"environment": "game"}):
                pass
        return rewards

    rewards = asyncio.run(episodes())
    assert Slot.created == 1 and rewards == [(Slot, 1.0)] * 3
    stats = window.summarize()
    assert stats["env/reset_s"] >= 0 and stats["env/reward_s"] >= 0


def test_concurrent_episodes_each_hold_their_own_instance():
    Slot.created = 0

    async def episodes():
        pool = EnvironmentPool(Slot, ThreadPoolExecutor(2), lambda: MetricsWindow())
        held = []

        async def one(task):
            async with pool.episode({"task": task}) as episode:
                held.append(episode.instance)
                await asyncio.sleep(0.05)  # both episodes run at once
                return episode.instance.task

        tasks = await asyncio.gather(one("a"), one("b"))
        async with pool.episode({"task": "c"}) as episode:  # later: a reused instance
            reused = episode.instance
        return tasks, held, reused

    tasks, held, reused = asyncio.run(episodes())
    assert tasks == ["a", "b"], "an instance is never shared by two running rollouts"
    assert held[0] is not held[1] and Slot.created == 2 and any(reused is h for h in held)


class RowTargetEnv:
    """The documentation's dataset-backed IncrementEnv: reset reads its task from the row's columns."""

    def reset(self, target, **kwargs) -> None:  # the row's `target` column arrives as a keyword argument
        self.counter = 0
        self.target = target

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:  # no docstring: offered with its typed parameters
        self.counter += step
        return self.counter


def test_dataset_backed_environment_reads_its_task_from_the_row():
    from datasets import Dataset

    from asyncgrpo.trainer.checks import check_agent_inputs, check_conversational

    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"Increment the counter to {i}."}] for i in range(1, 7)],
            "target": list(range(1, 7)),
        }
    )
    args = SimpleNamespace(max_steps=-1)  # epochs end training: the dataset owns the data
    check_agent_inputs([], dataset, [], RowTargetEnv, args)  # get_reward is the only reward source
    check_conversational(dataset, RowTargetEnv)
    row = dataset[2]

    async def episode():
        pool = EnvironmentPool(RowTargetEnv, ThreadPoolExecutor(1), lambda: MetricsWindow())
        async with pool.episode(row) as episode:
            episode.tools[0](step=3)
            return episode, await pool.reward(episode.instance)

    episode, reward = asyncio.run(episode())
    assert episode.prompt == row["prompt"], "reset() returned None: the row's prompt is the prompt"
    assert episode.instance.target == 3 and [tool.__name__ for tool in episode.tools] == ["increment"]
    assert reward == (RowTargetEnv, 1.0)


def test_reset_string_with_and_without_a_dataset_prompt():
    assert prompt_with_observation(None, "hi") == [{"role": "user", "content": "hi"}]
    assert prompt_with_observation([{"role": "user", "content": "a"}], "b") == [
        {"role": "user", "content": "a\n\nb"}
    ]
    with pytest.raises(ValueError, match="reset\\(\\) must return"):
        prompt_with_observation(None, None)


def test_environment_rewards_are_one_source_per_class():
    names, sources = environment_reward_sources([(Slot, 1.0), None, (Counter, 2.0)])
    assert names == ["Slot", "Counter"] and sources == [[1.0, None, None], [None, None, 2.0]]


def test_agent_inputs_are_checked_at_construction():
    from asyncgrpo.trainer.checks import check_agent_inputs

    args = SimpleNamespace(max_steps=-1)
    with pytest.raises(ValueError, match="set max_steps"):
        check_agent_inputs([], None, [], Counter, args)
    with pytest.raises(ValueError, match="reward_funcs is empty"):
        check_agent_inputs([], None, [multiply], None, args)
    with pytest.raises(ValueError, match="'environment' column"):
        check_agent_inputs([], None, [], {"a": Counter}, SimpleNamespace(max_steps=5))
    with pytest.raises(ValueError, match="share the name"):
        check_agent_inputs([multiply], None, [multiply, multiply], Counter, SimpleNamespace(max_steps=5))
    check_agent_inputs([], None, [], Counter, SimpleNamespace(max_steps=5))
