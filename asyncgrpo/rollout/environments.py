"""Environments: stateful objects whose public methods are a rollout's tools.

`environment_factory` is a class (any callable returning an instance) or a dict name -> factory,
routed by each dataset row's `environment` column. One instance serves one running rollout at a time
and is reused across episodes: per episode `reset(**row_columns)` may return the user prompt, the
public methods are the tools offered, and an optional `get_reward()` scores the finished episode.
Construction, `reset` and `get_reward` run on the tool thread pool, so a slow environment holds back
only its own rollout. Without a dataset, `EnvironmentOwnedData` stands in for it. The contract in
full: docs/agents.md#environments.
"""

from __future__ import annotations

import inspect
import time
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from asyncgrpo.errors import ConfigurationError, ContractError
from asyncgrpo.records.metrics import MetricsWindow
from asyncgrpo.rollout.tools import call_maybe_async

RESERVED_METHODS = ("reset", "get_reward")
ROUTING_COLUMN = "environment"


class EnvironmentOwnedData:
    """The dataset when the environment owns the data: every row is empty, reset() makes the task."""

    column_names: list[str] = []

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index) -> dict:
        return {}

    def __iter__(self):
        return iter([{}])


def environment_tools(instance: Any) -> list[Callable]:
    """The instance's public methods, in name order: what the model may call."""
    tools = []
    for name in sorted(dir(type(instance))):
        if name.startswith("_") or name in RESERVED_METHODS:
            continue
        attribute = getattr(instance, name)
        if inspect.ismethod(attribute) or inspect.isfunction(attribute):
            tools.append(attribute)
    return tools


def factory_defines_reward(factory: Any) -> bool:
    """Whether a factory's environments may score rollouts (unknown for a non-class factory)."""
    factories = factory.values() if isinstance(factory, dict) else [factory]
    return any(not inspect.isclass(f) or callable(getattr(f, "get_reward", None)) for f in factories)


def check_routing(factory: Any, dataset: Any) -> None:
    """A dict of environments needs the dataset's `environment` column to route each row."""
    if not isinstance(factory, dict):
        return
    if not factory:
        raise ConfigurationError(
            "environment_factory is an empty dict: give at least one name -> environment class"
        )
    columns = getattr(dataset, "column_names", None) or []
    if dataset is None or ROUTING_COLUMN not in columns:
        raise ConfigurationError(
            f"environment_factory is a dict ({sorted(factory)}): each train_dataset row must name its "
            f"environment in an {ROUTING_COLUMN!r} column"
        )


def prompt_with_observation(
    prompt: list[dict[str, Any]] | None, observation: str | None
) -> list[dict[str, Any]]:
    """The rollout's prompt: reset()'s string is the user prompt when the row has none, and is
    appended to the row prompt's last user message when it has one."""
    if observation is None:
        if prompt is None:
            raise ContractError(
                "the dataset row has no 'prompt' and the environment's reset() returned None: without a "
                "prompt column, reset() must return the user prompt as a string"
            )
        return prompt
    if not isinstance(observation, str):
        raise TypeError(f"reset() must return a string or None, got {type(observation).__name__}")
    if not prompt:
        return [{"role": "user", "content": observation}]
    messages = [dict(message) for message in prompt]
    if messages[-1].get("role") == "user" and isinstance(messages[-1].get("content"), str):
        messages[-1]["content"] = messages[-1]["content"] + "\n\n" + observation
    else:
        messages.append({"role": "user", "content": observation})
    return messages


@dataclass
class Episode:
    instance: Any
    prompt: list[dict[str, Any]]
    tools: list[Callable]


class EnvironmentPool:
    """Idle instances per environment name; a rollout takes one for its episode and gives it back."""

    def __init__(self, factory: Any, executor: Executor, metrics: Callable[[], MetricsWindow]):
        self.factories = dict(factory) if isinstance(factory, dict) else {None: factory}
        self.executor = executor
        self.metrics = metrics
        self._idle: dict[Any, list[Any]] = {name: [] for name in self.factories}

    def route(self, row: dict[str, Any]) -> Any:
        if None in self.factories:
            return None
        name = row.get(ROUTING_COLUMN)
        if name not in self.factories:
            raise ConfigurationError(
                f"dataset row routes to environment {name!r}, which environment_factory does not have "
                f"(it has {sorted(self.factories)})"
            )
        return name

    @asynccontextmanager
    async def episode(self, row: dict[str, Any]) -> AsyncIterator[Episode]:
        name = self.route(row)
        idle = self._idle[name]
        instance = idle.pop() if idle else await call_maybe_async(self.factories[name], self.executor)
        try:
            columns = {key: value for key, value in row.items() if key != ROUTING_COLUMN}
            started = time.monotonic()
            observation = await call_maybe_async(instance.reset, self.executor, **columns)
            self.metrics().record("env/reset_s", time.monotonic() - started)
            yield Episode(
                instance, prompt_with_observation(row.get("prompt"), observation), environment_tools(instance)
            )
        finally:
            idle.append(instance)

    async def reward(self, instance: Any) -> tuple[type, float] | None:
        """(the class, its reward) when the environment scores itself, else None."""
        get_reward = getattr(instance, "get_reward", None)
        if not callable(get_reward):
            return None
        started = time.monotonic()
        value = await call_maybe_async(get_reward, self.executor)
        self.metrics().record("env/reward_s", time.monotonic() - started)
        if value is None:
            return None
        try:
            return type(instance), float(value)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"{type(instance).__name__}.get_reward() must return a float, got {value!r}"
            ) from error


def environment_reward_sources(
    env_rewards: list[tuple[type, float] | None],
) -> tuple[list[str], list[list[float | None]]]:
    """One reward source per environment class (named after it), None for rollouts it did not score."""
    classes = []
    for entry in env_rewards:
        if entry is not None and entry[0] not in classes:
            classes.append(entry[0])
    sources = [
        [entry[1] if entry is not None and entry[0] is cls else None for entry in env_rewards]
        for cls in classes
    ]
    return [cls.__name__ for cls in classes], sources
