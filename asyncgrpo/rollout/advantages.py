"""From a group's rewards to its rollouts' advantages, with TRL 1.16's reward shaping: `reward_weights`,
`multi_objective_aggregation` (GDPO's normalize-then-sum) and `scale_rewards` (group, batch, none).

The worker scores one group at a time, so what needs the whole batch is finished by the trainer when it
takes a step's samples (`scale_over_batch`): the batch is the step's samples, one value per rollout.
docs/algorithm.md, "Advantages", gives the formulas.
"""

from __future__ import annotations

import numpy as np

from asyncgrpo.records.sample import Sample
from asyncgrpo.rollout.scoring import ADVANTAGE_EPSILON, group_advantages
from asyncgrpo.rollout.types import Rollout, RolloutGroup


def source_weights(reward_weights: list[float] | None, num_functions: int, num_sources: int) -> list[float]:
    """One weight per reward source: the reward functions' (1 each when None), then 1 for every other
    source (environments' get_reward, Rollout.reward), as TRL weighs an environment's reward."""
    weights = [1.0] * num_functions if reward_weights is None else [float(w) for w in reward_weights]
    return weights + [1.0] * (num_sources - num_functions)


def decoupled_rewards(sources: list[list[float | None]], weights: list[float]) -> np.ndarray:
    """GDPO: per rollout, sum_k w_k (r_k - mean_k) / (std_k + eps), each source normalized over the
    group's rollouts it scored (population std), the sum over the sources that scored the rollout; NaN
    where none did."""
    num_rollouts = len(sources[0]) if sources else 0
    total = np.full(num_rollouts, np.nan)
    for source, weight in zip(sources, weights):
        values = np.array([np.nan if value is None else float(value) for value in source])
        scored = ~np.isnan(values)
        if not scored.any():
            continue
        normalized = (values[scored] - values[scored].mean()) / (values[scored].std() + ADVANTAGE_EPSILON)
        indices = np.flatnonzero(scored)
        total[indices] = np.where(np.isnan(total[indices]), 0.0, total[indices]) + weight * normalized
    return total


def advantage_basis(group: RolloutGroup, aggregation: str) -> np.ndarray:
    """The per-rollout values a group's advantages are computed from, and its degenerate check is
    decided on: the (weighted) rewards, or GDPO's decoupled sum."""
    if aggregation == "normalize_then_sum":
        return decoupled_rewards(group.source_rewards, group.source_weights)
    return group.rewards


def rollout_advantages(group: RolloutGroup, scale_rewards: str, aggregation: str) -> np.ndarray:
    """The default `compute_advantages`: what the worker can compute from the group alone. 'group':
    final; 'batch' and GDPO: the trainer finishes them over the step (`scale_over_batch`)."""
    basis = advantage_basis(group, aggregation)
    if aggregation == "normalize_then_sum":
        return np.nan_to_num(basis, nan=0.0)
    return group_advantages(basis, scale=scale_rewards == "group")


def is_truncated(rollout: Rollout, eos_token_ids: list[int] | set[int]) -> bool:
    """The rollout's last turn did not end with EOS: it was cut (max_completion_length, max_model_len)."""
    last = rollout.turns[-1].output_ids if rollout.turns else []
    return not (bool(last) and last[-1] in eos_token_ids)


def scale_over_batch(samples: list[Sample], scale_rewards: str, aggregation: str) -> None:
    """The step's advantages, in place, where they need the batch: GDPO standardizes the decoupled sums
    over the step's rollouts, (x - mean) / (std + eps); scale_rewards='batch' divides each centered
    reward by the std of the step's rewards. One value per rollout (a rollout split into several samples
    counts once); population std, as the group's."""
    gdpo = aggregation == "normalize_then_sum"
    if not samples or not (gdpo or scale_rewards == "batch"):
        return
    by_rollout = {s.rollout_id or id(s): (s.advantage if gdpo else s.reward) for s in samples}
    values = np.array(list(by_rollout.values()), dtype=np.float64)
    values = values[~np.isnan(values)]
    mean, std = (values.mean(), values.std()) if len(values) else (0.0, 0.0)
    for sample in samples:
        centered = sample.advantage - mean if gdpo else sample.advantage
        sample.advantage = float(centered / (std + ADVANTAGE_EPSILON))
