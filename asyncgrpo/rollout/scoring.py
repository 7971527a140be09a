"""Scoring a group: calling the reward functions, summing sources, group-normalized advantages.

Reward functions receive `prompts`, `completions`, `completion_ids` and every dataset column except
`prompt` as keyword arguments. Sync functions run in threads and async ones are awaited, all at
once, so a slow judge's latency overlaps with the others'. A function may return None for an item:
that item's sum leaves it out; an item no source scored is NaN. A non-finite value (inf, NaN) is an
error: one inf would turn the group's advantages, then the loss, then the weights into NaN. Each call
has a deadline (`reward_timeout`): a function that never returns stops the run, naming itself.
Formulas: docs/algorithm.md.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import time
import traceback
from concurrent.futures import Executor
from typing import Any, Callable

import numpy as np

from asyncgrpo.records.sample import Sample
from asyncgrpo.rollout.environments import environment_reward_sources
from asyncgrpo.rollout.reward_errors import RewardCallFailure, RewardFunctionError
from asyncgrpo.rollout.types import RolloutGroup

ADVANTAGE_EPSILON = 1e-4


def reward_function_name(function: Callable) -> str:
    """The name metrics use: the function's, a partial's target's, or a callable instance's class."""
    while isinstance(function, functools.partial):
        function = function.func
    name = getattr(function, "__name__", None)
    return name if name else type(function).__name__


def _is_async(function: Callable) -> bool:
    while isinstance(function, functools.partial):
        function = function.func
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
        getattr(function, "__call__", None)
    )


async def call_reward_functions(
    functions: list[Callable],
    executor: Executor,
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    reward_kwargs: dict[str, list[Any]],
    timeout_s: float = math.inf,
    where: str = "",
    catch_errors: bool = False,
) -> list[list[float | None] | RewardCallFailure]:
    """Every function's rewards for the group (one list per function), computed concurrently.
    A call that takes longer than `timeout_s` raises RewardFunctionError naming the function and
    `where` (the dataset row); a sync function's thread cannot be stopped, so the caller must not
    wait for it (the rollout process exits without joining it). `catch_errors`: an exception the
    function raises comes back as a RewardCallFailure in its place (rollout/reward_errors.py)."""
    loop = asyncio.get_running_loop()
    kwargs = dict(reward_kwargs, prompts=prompts, completions=completions, completion_ids=completion_ids)

    async def one(function: Callable) -> list[float | None]:
        if _is_async(function):
            call = function(**kwargs)
        else:
            call = loop.run_in_executor(executor, functools.partial(function, **kwargs))
        try:
            result = await asyncio.wait_for(call, None if math.isinf(timeout_s) else timeout_s)
        except asyncio.TimeoutError:
            raise RewardFunctionError(
                f"reward function {reward_function_name(function)!r} did not return within "
                f"reward_timeout={timeout_s:g} s{where}; it is stuck (a judge that never answers?). Fix it "
                "or raise reward_timeout."
            ) from None
        except Exception as error:
            if not catch_errors:
                raise
            return RewardCallFailure(reward_function_name(function), error, traceback.format_exc())
        return _checked_rewards(function, result, len(completions))

    return list(await asyncio.gather(*(one(function) for function in functions)))


def _checked_rewards(function: Callable, result: Any, expected: int) -> list[float | None]:
    name = reward_function_name(function)
    if isinstance(result, np.ndarray):
        result = result.tolist()
    if not isinstance(result, (list, tuple)) or len(result) != expected:
        raise TypeError(
            f"reward function {name!r} must return a list of {expected} floats (one per completion, None "
            f"where it does not apply), got {type(result).__name__}"
            + (f" of length {len(result)}" if hasattr(result, "__len__") else "")
        )
    checked = []
    for value in result:
        if value is None:
            checked.append(None)
        elif isinstance(value, (int, float, np.integer, np.floating)):
            checked.append(finite_reward(float(value), f"reward function {name!r}"))
        else:
            raise TypeError(f"reward function {name!r} returned {value!r}; rewards must be floats or None")
    return checked


def finite_reward(value: float, source: str) -> float:
    """`value`, or RewardFunctionError when it is inf or NaN (None is how a source says "not scored")."""
    if not math.isfinite(value):
        raise RewardFunctionError(
            f"{source} returned {value!r}: rewards must be finite (an inf or NaN reward makes the group's "
            "advantages, the loss and then the weights NaN). Return None for a completion it does not score."
        )
    return value


def checked_extra_sources(
    env_rewards: list[tuple[type, float] | None], rollout_rewards: list[float | None]
) -> tuple[list[str], list[list[float | None]], list[float | None]]:
    """The reward sources beside the reward functions, checked finite: (each environment class's
    name, its values per rollout, the Rollout.reward values a `generate_one` set)."""
    env_names, env_sources = environment_reward_sources(env_rewards)
    env_sources = [
        [None if value is None else finite_reward(value, "an environment's get_reward()") for value in source]
        for source in env_sources
    ]
    checked = [
        None if reward is None else finite_reward(float(reward), "a Rollout.reward set by generate_one")
        for reward in rollout_rewards
    ]
    return env_names, env_sources, checked


def sum_rewards(
    sources: list[list[float | None]], num_rollouts: int, weights: list[float] | None = None
) -> np.ndarray:
    """Per rollout, the (weighted) sum over sources that scored it; NaN where none did. `sources` holds
    one list per source (reward function, environment, Rollout.reward), None where it did not score;
    `weights` one weight per source (None: 1 each)."""
    totals = np.full(num_rollouts, np.nan)
    for position, source in enumerate(sources):
        weight = 1.0 if weights is None else weights[position]
        for index, value in enumerate(source):
            if value is None or (isinstance(value, float) and math.isnan(value)):
                continue
            value = weight * value
            totals[index] = value if np.isnan(totals[index]) else totals[index] + value
    return totals


def group_advantages(rewards: np.ndarray, scale: bool = True) -> np.ndarray:
    """GRPO advantages over the scored (non-NaN) rollouts S: (R - mean_S) / (std_S + eps), with
    the population std (`scale=False`: R - mean_S, scale_rewards 'none' or 'batch'); unscored
    rollouts get 0."""
    advantages = np.zeros(len(rewards), dtype=np.float64)
    scored = ~np.isnan(rewards)
    if scored.sum() < 2:
        return advantages
    values = rewards[scored]
    centered = values - values.mean()
    advantages[scored] = centered / (values.std() + ADVANTAGE_EPSILON) if scale else centered
    return advantages


def is_degenerate_group(rewards: np.ndarray) -> bool:
    """A group carries no signal, and is dropped, when fewer than two rollouts were scored or all
    scored rewards are equal: decided on the rewards, whatever the advantages are."""
    scored = rewards[~np.isnan(rewards)]
    return len(scored) < 2 or bool(np.all(scored == scored[0]))


def training_samples(
    group: RolloutGroup,
    advantages: np.ndarray,
    left_out: frozenset[int] = frozenset(),
    keep_unscored: bool = False,
) -> list[Sample]:
    """Training samples of a kept group. Unscored rollouts (advantage 0) add no gradient, only
    forward cost, so they are not queued, unless `keep_unscored` (distillation: the teacher's scores
    train them); nor are the rollouts `left_out` (truncated ones, with mask_truncated_completions)."""
    samples = []
    now = time.time()
    for index, sequences in enumerate(group.completions_sequences):
        if (np.isnan(group.rewards[index]) and not keep_unscored) or index in left_out:
            continue
        for sequence in sequences:
            samples.append(
                Sample(
                    token_ids=sequence.token_ids,
                    trained=sequence.trained,
                    sampler_logprobs=sequence.sampler_logprobs,
                    advantage=float(advantages[index]),
                    group_id=group.group_id,
                    top_ids=sequence.top_ids,
                    top_logprobs=sequence.top_logprobs,
                    candidate_sets=sequence.candidate_sets,
                    model_version=sequence.model_version,
                    routed_experts=sequence.routed_experts,
                    row_index=group.row_index,
                    stream_index=group.stream_index,
                    epoch=group.epoch,
                    reward=float(group.rewards[index]),
                    rollout_id=group.rollouts[index].rollout_id,
                    queued_at=now,
                )
            )
    return samples
