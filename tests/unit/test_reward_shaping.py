"""Reward shaping by hand (docs/algorithm.md, "Advantages"): reward weights, GDPO's normalize-then-sum,
scale_rewards 'none' and 'batch' (finished over the step's samples), the truncated-completion mask on a
planted group scored as the rollout worker scores it, and DAPO's soft overlong punishment."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)
from asyncgrpo.records.metrics import MetricsWindow
from asyncgrpo.records.sample import Sample
from asyncgrpo.rewards import get_soft_overlong_punishment
from asyncgrpo.rollout.advantages import (
    decoupled_rewards,
    is_truncated,
    rollout_advantages,
    scale_over_batch,
    source_weights,
)
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.scheduler import RolloutScheduler
from asyncgrpo.rollout.scoring import ADVANTAGE_EPSILON, sum_rewards
from asyncgrpo.rollout.sequences import build_training_sequences
from asyncgrpo.rollout.types import Rollout, RolloutGroup, TurnRecord

EOS = 2
EPS = ADVANTAGE_EPSILON


def test_weights_apply_per_source_and_unscored_stays_nan():
    # Two functions weighted 2 and 1, an environment weighing 1: None where a source does not score.
    weights = source_weights([2.0, 1.0], num_functions=2, num_sources=3)
    assert weights == [2.0, 1.0, 1.0]
    totals = sum_rewards([[1.0, 0.0, None], [0.5, 1.0, None], [None, 3.0, None]], 3, weights)
    assert totals[:2].tolist() == [2.5, 4.0] and math.isnan(totals[2])
    assert source_weights(None, 2, 4) == [1.0] * 4


def test_gdpo_normalizes_each_source_in_the_group_then_sums():
    f1, f2 = [1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]
    # f1: mean 0.5, std 0.5; f2: mean 0.25, std sqrt(3) / 4
    std2 = math.sqrt(3) / 4
    expected = [
        2 * (f1[i] - 0.5) / (0.5 + EPS) + (f2[i] - 0.25) / (std2 + EPS) for i in range(4)
    ]  # weights 2 and 1
    np.testing.assert_allclose(decoupled_rewards([f1, f2], [2.0, 1.0]), expected)
    # A source that scored some rollouts only is normalized over those; a rollout none scored is NaN.
    partial = decoupled_rewards([[1.0, 3.0, None], [None, None, None]], [1.0, 1.0])
    np.testing.assert_allclose(partial[:2], [-1 / (1 + EPS), 1 / (1 + EPS)])
    assert math.isnan(partial[2])


def group_of(rewards_per_source, weights, outputs=None):
    """A planted group: rollout i generated outputs[i] (default: a token then EOS), scored by sources."""
    size = len(rewards_per_source[0])
    outputs = outputs or [[5 + i, EOS] for i in range(size)]
    rollouts, sequences = [], []
    for output in outputs:
        turn = TurnRecord(
            prompt_ids=[1, 9, 9], output_ids=list(output), output_log_probs=[-1.0] * len(output)
        )
        rollouts.append(Rollout(completion=[], completion_ids=list(output), turns=[turn]))
        sequences.append(build_training_sequences([turn])[0])
    group = RolloutGroup(
        prompts=[[]] * size, reward_kwargs={}, completions=[[]] * size, completions_ids=outputs,
        completions_sequences=sequences, tool_call_counts=[0] * size, tool_failure_counts=[0] * size,
        model_version=0, group_id=7, row_index=3, env_rewards=[None] * size, rollout_rewards=[None] * size,
        rollouts=rollouts,
    )  # fmt: skip
    group.source_rewards, group.source_weights = rewards_per_source, weights
    group.rewards = sum_rewards(rewards_per_source, size, weights)
    return group


def test_scale_rewards_none_and_batch_leave_the_group_std_out():
    group = group_of([[1.0, 0.0, 0.0, 3.0]], [1.0])
    np.testing.assert_allclose(rollout_advantages(group, "none", "sum_then_normalize"), [0, -1, -1, 2])
    np.testing.assert_allclose(rollout_advantages(group, "batch", "sum_then_normalize"), [0, -1, -1, 2])
    std = np.std([1.0, 0.0, 0.0, 3.0])
    np.testing.assert_allclose(
        rollout_advantages(group, "group", "sum_then_normalize"), np.array([0, -1, -1, 2]) / (std + EPS)
    )


def samples_of(advantages, rewards, rollout_ids):
    return [
        Sample(
            np.zeros(3, np.int64),
            np.array([False, True, True]),
            np.zeros(2, np.float32),
            a,
            0,
            reward=r,
            rollout_id=i,
        )  # fmt: skip
        for a, r, i in zip(advantages, rewards, rollout_ids)
    ]


def test_batch_scaling_divides_by_the_std_of_the_steps_rewards_once_per_rollout():
    # Rollout "b" was split into two samples (a fork): its reward counts once. Rewards 1, 0, 3 -> std.
    samples = samples_of([0.5, -0.5, -0.5, 1.0], [1.0, 0.0, 0.0, 3.0], ["a", "b", "b", "c"])
    scale_over_batch(samples, "batch", "sum_then_normalize")
    std = np.std([1.0, 0.0, 3.0])
    np.testing.assert_allclose([s.advantage for s in samples], np.array([0.5, -0.5, -0.5, 1.0]) / (std + EPS))


def test_gdpo_standardizes_over_the_step():
    samples = samples_of([1.0, -1.0, 2.0], [0.0, 0.0, 0.0], ["a", "b", "c"])
    scale_over_batch(samples, "group", "normalize_then_sum")  # GDPO: scale_rewards does not apply
    values = np.array([1.0, -1.0, 2.0])
    np.testing.assert_allclose(
        [s.advantage for s in samples], (values - values.mean()) / (values.std() + EPS)
    )
    untouched = samples_of([0.7], [1.0], ["a"])
    scale_over_batch(untouched, "group", "sum_then_normalize")  # group scaling is final in the worker
    assert untouched[0].advantage == 0.7


def scored(group: RolloutGroup, per_function, scoring) -> list[Sample]:
    """The group scored as the rollout worker scores it (RolloutScheduler._scored_samples), under
    `scoring` (the fields of ScoringSettings it reads)."""
    settings = SimpleNamespace(scoring=scoring)
    loop = SimpleNamespace(settings=settings, eos_token_ids=[EOS], metrics=MetricsWindow())
    loop.compute_advantages = lambda g: AsyncRolloutLoop.compute_advantages(loop, g)
    scheduler = SimpleNamespace(scoring=scoring, loop=loop, teachers=None)  # a run without a teacher
    return RolloutScheduler._scored_samples(
        scheduler, group, per_function, [lambda **kw: None] * len(per_function)
    )


def config(**fields):
    values = dict(
        reward_weights=None, scale_rewards="group", multi_objective_aggregation="sum_then_normalize",
        mask_truncated_completions=False,
    )  # fmt: skip
    values.update(fields)
    return SimpleNamespace(**values)


def test_a_planted_group_weighted_aggregated_and_truncation_masked():
    # Rollouts 0 and 2 end with EOS, 1 and 3 were cut. Two functions weighted 2 and 1.
    outputs = [[5, EOS], [6, 7], [8, EOS], [9, 10]]
    per_function = [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0]]
    group = group_of(per_function, [1.0, 1.0], outputs)
    samples = scored(group, per_function, config(reward_weights=[2.0, 1.0]))
    assert group.rewards.tolist() == [2.0, 1.0, 1.0, 3.0]  # weighted sums
    assert len(samples) == 4
    rewards = np.array([2.0, 1.0, 1.0, 3.0])
    np.testing.assert_allclose(
        [s.advantage for s in samples], (rewards - rewards.mean()) / (rewards.std() + EPS)
    )
    masked = scored(group, per_function, config(reward_weights=[2.0, 1.0], mask_truncated_completions=True))
    # The cut rollouts still count in the group's advantages, but are not trained.
    assert [s.reward for s in masked] == [2.0, 1.0]
    np.testing.assert_allclose([s.advantage for s in masked], [s.advantage for s in samples[::2]])
    assert is_truncated(group.rollouts[1], [EOS]) and not is_truncated(group.rollouts[0], [EOS])


def test_gdpo_decides_the_dropped_groups_on_the_decoupled_sums():
    # Weights 1 and 1, f1 = [1, 0], f2 = [0, 1]: equal totals, and equal decoupled sums (0, 0): dropped.
    per_function = [[1.0, 0.0], [0.0, 1.0]]
    assert (
        scored(
            group_of(per_function, [1.0, 1.0]),
            per_function,
            config(multi_objective_aggregation="normalize_then_sum"),
        )
        == []
    )
    # Weights 2 and 1: the decoupled sums differ, so the group trains, with them as its pre-batch values.
    samples = scored(
        group_of(per_function, [1.0, 1.0]),
        per_function,
        config(reward_weights=[2.0, 1.0], multi_objective_aggregation="normalize_then_sum"),
    )
    np.testing.assert_allclose([s.advantage for s in samples], [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS)])


@pytest.mark.parametrize(
    "length, expected", [(80, 0.0), (81, -0.05), (90, -0.5), (100, -1.0), (101, -1.0), (0, 0.0)]
)
def test_soft_overlong_punishment_by_hand(length, expected):
    reward = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    assert reward(completion_ids=[[1] * length]) == [pytest.approx(expected)]
    assert reward.__name__ == "soft_overlong_punishment_reward"


def test_soft_overlong_punishment_refuses_a_band_past_the_limit():
    assert get_soft_overlong_punishment(10, 0)(completion_ids=[[1] * 10, [1] * 11]) == [0.0, -1.0]
    with pytest.raises(ValueError, match="0 <= soft_punish_cache <= max_completion_len"):
        get_soft_overlong_punishment(10, 20)
