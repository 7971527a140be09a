"""The figures of one evaluation: held-out reward, pass@k and completion lengths (docs/metrics.md).

Pure functions over what the evaluation sampled and scored. A rollout *passes* when its summed
reward reaches `eval_pass_threshold`; an unscored rollout (no source gave it a reward) fails.
pass@k is the unbiased estimator of the chance that at least one of k rollouts drawn without
replacement from a prompt's n passes, 1 - C(n - c, k) / C(n, k) with c passing rollouts, averaged
over prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

import numpy as np

from asyncgrpo.errors import ConfigurationError


@dataclass
class PromptOutcome:
    """One evaluated prompt: its rollouts' summed rewards (NaN: unscored), each reward source's
    values (None where it did not score), and each rollout's generated tokens and clipping."""

    rewards: np.ndarray
    per_source: dict[str, list[float | None]]
    lengths: list[int]
    clipped: list[bool]


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


def summarize(outcomes: list[PromptOutcome], threshold: float) -> dict[str, float]:
    """The evaluation's figures, unprefixed (the trainer adds `eval_` or `eval_{name}_`): `reward`
    and `reward_std` over every scored rollout, `rewards/{source}/mean`, `pass@k` for each k of
    `pass_k_values`, `completions/mean_length` and `completions/clipped_ratio`."""
    if not outcomes:
        raise ConfigurationError("an evaluation needs at least one prompt")
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
    lengths = [length for outcome in outcomes for length in outcome.lengths]
    clipped = [flag for outcome in outcomes for flag in outcome.clipped]
    figures["completions/mean_length"] = float(np.mean(lengths))
    figures["completions/clipped_ratio"] = float(np.mean(clipped))
    return figures
