"""Config fields of how rewards become advantages: reward weights, the aggregation of several reward
functions (GDPO), the reward scaling, and the truncated-completion mask. TRL 1.16 GRPOConfig's names
and defaults; docs/algorithm.md gives the formulas and what "batch" means asynchronously.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


@dataclass
class RewardShapingFields:
    """From each reward function's scores to each rollout's advantage."""

    reward_weights: list[float] | None = field(
        default=None,
        metadata={
            "help": "One weight per reward function (in reward_funcs' order); an environment's get_reward "
            "and a Rollout.reward weigh 1. None: every function weighs 1 (TRL's default)."
        },
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={
            "help": "'sum_then_normalize': the weighted sum of the rewards, then scale_rewards (TRL's "
            "default). 'normalize_then_sum' (GDPO): each function's rewards normalized in the group, their "
            "weighted sum then standardized over the step's batch (scale_rewards does not apply)."
        },
    )
    scale_rewards: str | bool = field(
        default="group",
        metadata={
            "help": "What the centered rewards are divided by: 'group' (True) the group's std, 'batch' the "
            "std of the rewards of the step's samples (PPO Lite), 'none' (False) nothing (Dr. GRPO). "
            "'group': TRL's default and asyncgrpo's."
        },
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={
            "help": "Leave out of the loss every rollout whose last turn did not end with EOS (cut at "
            "max_completion_length): DAPO's advice, so a cut answer is not penalized as a wrong one. It "
            "still counts in its group's advantages. False: TRL's default."
        },
    )

    def _resolve_reward_shaping(self) -> None:
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)

    def _validate_reward_shaping(self, fail) -> None:
        if self.scale_rewards not in SCALE_REWARDS:
            fail(
                f"scale_rewards={self.scale_rewards!r} must be one of {', '.join(SCALE_REWARDS)} "
                "(or True/False)"
            )
        if self.multi_objective_aggregation not in AGGREGATIONS:
            fail(
                f"multi_objective_aggregation={self.multi_objective_aggregation!r} must be one of "
                f"{', '.join(AGGREGATIONS)}"
            )
        if self.reward_weights is not None:
            if not isinstance(self.reward_weights, (list, tuple)) or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
                for w in self.reward_weights
            ):
                fail(
                    f"reward_weights={self.reward_weights!r} must be a list of finite numbers, one per "
                    "reward function"
                )
            self.reward_weights = [float(w) for w in self.reward_weights]
