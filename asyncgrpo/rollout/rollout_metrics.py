"""The rollout process's per-rollout and per-group metrics (TRL's names; meanings in docs/metrics.md).

Recorded when a rollout finishes or a group is scored, so they include groups that are later
dropped (no reward signal) or whose samples go stale; the trainer-side metrics (`reward_trained`,
`sample/*`) cover only what was trained.
"""

from __future__ import annotations

import numpy as np

from asyncgrpo.records.metrics import MetricsWindow, Reduce
from asyncgrpo.rollout.advantages import is_truncated
from asyncgrpo.rollout.sequences import ReconcileStats
from asyncgrpo.rollout.types import Rollout, RolloutGroup


def record_rollout_metrics(
    metrics: MetricsWindow,
    rollout: Rollout,
    duration_s: float,
    num_samples: int,
    reconcile: ReconcileStats,
    eos_token_ids: list[int],
) -> None:
    metrics.record("rollout/duration_s", duration_s)
    metrics.record("rollout/turns_mean", len(rollout.turns))
    metrics.record("rollout/turns_max", len(rollout.turns), Reduce.MAX)
    metrics.record("rollout/samples_per_rollout", num_samples)
    if reconcile.transitions:
        metrics.record(
            "rollout/fork_frac", reconcile.forks / reconcile.transitions, weight=reconcile.transitions
        )
        for drift in reconcile.drift_tokens:
            metrics.record("rollout/drift_tokens_mean", drift)
            metrics.record("rollout/drift_tokens_max", drift, Reduce.MAX)
    # Generated tokens only: tool results are context, not the model's output.
    length = sum(len(turn.output_ids) for turn in rollout.turns)
    terminated = not is_truncated(rollout, eos_token_ids)
    metrics.record("completions/mean_length", length)
    metrics.record("completions/min_length", length, Reduce.MIN)
    metrics.record("completions/max_length", length, Reduce.MAX)
    metrics.record("completions/clipped_ratio", 0.0 if terminated else 1.0)
    if terminated:
        metrics.record("completions/mean_terminated_length", length)
        metrics.record("completions/min_terminated_length", length, Reduce.MIN)
        metrics.record("completions/max_terminated_length", length, Reduce.MAX)


def record_group_metrics(
    metrics: MetricsWindow,
    group: RolloutGroup,
    per_function: list[list[float | None]],
    function_names: list[str],
    dropped: bool,
    num_samples: int,
) -> None:
    """Reward and saturation metrics of one scored group (how to read them together: docs/metrics.md,
    "Rewards and saturation")."""
    for name, values in zip(function_names, per_function):
        scored = [value for value in values if value is not None]
        for value in scored:
            metrics.record(f"rewards/{name}/mean", value)
        if not dropped and scored and num_samples:
            metrics.record(f"rewards/{name}/group_std", float(np.std(scored)), weight=num_samples)
    rewards = group.rewards
    scored_totals = rewards[~np.isnan(rewards)]
    for value in scored_totals:
        metrics.record("reward", float(value))
    if not dropped and num_samples and len(scored_totals):
        metrics.record("reward_group_std", float(np.std(scored_totals)), weight=num_samples)
    metrics.record("frac_zero_std_groups", 1.0 if dropped else 0.0)
    # TRL's GRPOTrainer name for the same share: what a user coming from it looks for.
    metrics.record("frac_reward_zero_std", 1.0 if dropped else 0.0)
    if dropped and len(scored_totals):
        metrics.record("reward_zero_std_groups", float(np.mean(scored_totals)))
    seen: set[tuple] = set()
    duplicates = 0
    for rollout in group.rollouts:
        key = tuple(tuple(turn.output_ids) for turn in rollout.turns)
        duplicates += key in seen
        seen.add(key)
    if group.rollouts:
        metrics.record(
            "completions/duplicate_frac", duplicates / len(group.rollouts), weight=len(group.rollouts)
        )
