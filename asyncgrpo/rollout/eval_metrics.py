"""The figures of one evaluation: held-out reward, pass@k, completion lengths and, with teachers, how
far the policy is from them (docs/metrics.md).

Pure functions over what the evaluation sampled and scored. A rollout *passes* when its summed
reward reaches `eval_pass_threshold`; an unscored rollout (no source gave it a reward) fails.
pass@k is the unbiased estimator of the chance that at least one of k rollouts drawn without
replacement from a prompt's n passes, 1 - C(n - c, k) / C(n, k) with c passing rollouts, averaged
over prompts. The teacher figures are per completion token: the teacher's log-prob of the token the
policy sampled, and the sampled log-prob minus it, a one-sample estimate of the per-token reverse KL
to the teacher (the token was drawn from the policy, so the difference averages to KL(policy || teacher)).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

import numpy as np

from asyncgrpo.errors import ConfigurationError


@dataclass
class TeacherTokens:
    """One eval prompt's completion tokens as its teacher scored them: per token, the log-prob the
    policy's server sampled it with and the teacher's log-prob of it (NaN where it reported none)."""

    teacher_id: str
    sampled: np.ndarray  # (n,) float
    teacher: np.ndarray  # (n,) float


@dataclass
class PromptOutcome:
    """One evaluated prompt: its rollouts' summed rewards (NaN: unscored), each reward source's
    values (None where it did not score), each rollout's generated tokens and clipping, and with
    teachers its completion tokens as its teacher scored them."""

    rewards: np.ndarray
    per_source: dict[str, list[float | None]]
    lengths: list[int]
    clipped: list[bool]
    teacher: TeacherTokens | None = None


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a prompt with `n` rollouts of which `c` pass: the chance that a draw
    of k of them without replacement holds at least one passing rollout."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ConfigurationError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_k_values(n: int) -> list[int]:
    """The k reported for n rollouts per prompt: 1, 2, 4, ... up to n, and n itself."""
    values = [1]
    while values[-1] * 2 <= n:
        values.append(values[-1] * 2)
    if values[-1] != n:
        values.append(n)
    return values


def summarize(outcomes: list[PromptOutcome], threshold: float, per_teacher: bool = False) -> dict[str, float]:
    """The evaluation's figures, unprefixed (the trainer adds `eval_` or `eval_{name}_`): the reward
    figures (`reward_figures`) when a reward source scored the run, `completions/mean_length` and
    `completions/clipped_ratio`, and the teacher figures (`teacher_figures`) when teachers scored it;
    `per_teacher`: the run has several teachers, each with its own figure."""
    if not outcomes:
        raise ConfigurationError("an evaluation needs at least one prompt")
    figures = reward_figures(outcomes, threshold) if has_reward_source(outcomes) else {}
    lengths = [length for outcome in outcomes for length in outcome.lengths]
    clipped = [flag for outcome in outcomes for flag in outcome.clipped]
    figures["completions/mean_length"] = float(np.mean(lengths))
    figures["completions/clipped_ratio"] = float(np.mean(clipped))
    scored = [outcome.teacher for outcome in outcomes if outcome.teacher is not None]
    if scored:
        figures.update(teacher_figures(scored, per_teacher))
    return figures


def has_reward_source(outcomes: list[PromptOutcome]) -> bool:
    """Whether the run has a reward source: a reward function or an environment (each a source
    whatever it gave), or a rollout loop that set a Rollout.reward. Distillation has none, and its
    evaluation reports no reward figures rather than NaN rewards and pass rates of 0."""
    return any(outcome.per_source or not np.all(np.isnan(outcome.rewards)) for outcome in outcomes)


def reward_figures(outcomes: list[PromptOutcome], threshold: float) -> dict[str, float]:
    """`reward` and `reward_std` over every scored rollout, `rewards/{source}/mean`, and `pass@k` for
    each k of `pass_k_values`."""
    every = np.concatenate([outcome.rewards for outcome in outcomes])
    scored = every[~np.isnan(every)]
    figures = {
        "reward": float(scored.mean()) if len(scored) else float("nan"),
        "reward_std": float(scored.std()) if len(scored) else float("nan"),
    }
    names = list(dict.fromkeys(name for outcome in outcomes for name in outcome.per_source))
    for name in names:
        values = [v for outcome in outcomes for v in outcome.per_source.get(name, []) if v is not None]
        figures[f"rewards/{name}/mean"] = float(np.mean(values)) if values else float("nan")
    sizes = {len(outcome.rewards) for outcome in outcomes}
    n = min(sizes)  # every prompt has num_generations_eval rollouts; min keeps k valid for all
    for k in pass_k_values(n):
        per_prompt = [
            pass_at_k(len(outcome.rewards), int(np.sum(outcome.rewards >= threshold)), k)
            for outcome in outcomes
        ]
        figures[f"pass@{k}"] = float(np.mean(per_prompt))
    return figures


def teacher_figures(scored: list[TeacherTokens], per_teacher: bool) -> dict[str, float]:
    """Over every completion token a teacher scored: `teacher_logprob`, the mean log-prob the teacher
    gives the sampled token, and `teacher_kl`, the mean of the sampled log-prob minus the teacher's;
    with `per_teacher`, `teacher_kl/{teacher_id}` over each teacher's tokens. A token without both
    log-probs (the teacher reported none) enters no mean; NaN when no token has them."""
    sampled, teacher = _scored_pairs(scored)
    figures = {"teacher_logprob": _mean(teacher), "teacher_kl": _mean(sampled - teacher)}
    if per_teacher:
        for teacher_id in dict.fromkeys(tokens.teacher_id for tokens in scored):
            own_sampled, own_teacher = _scored_pairs([t for t in scored if t.teacher_id == teacher_id])
            figures[f"teacher_kl/{teacher_id}"] = _mean(own_sampled - own_teacher)
    return figures


def _scored_pairs(scored: list[TeacherTokens]) -> tuple[np.ndarray, np.ndarray]:
    """(sampled, teacher) log-probs of the tokens that have both, as float64."""
    sampled = np.concatenate([tokens.sampled for tokens in scored]).astype(np.float64)
    teacher = np.concatenate([tokens.teacher for tokens in scored]).astype(np.float64)
    both = np.isfinite(sampled) & np.isfinite(teacher)
    return sampled[both], teacher[both]


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if len(values) else float("nan")
