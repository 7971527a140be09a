"""DAPO's soft overlong punishment (Eq. 13 of the DAPO paper): a reward source that penalizes a
completion for its length near and past the limit, and never rewards a shorter one.

With L_max the length limit and L_cache the soft band below it, for a completion of |y| generated
tokens (over all its turns):

    R(y) = 0                                 |y| <= L_max - L_cache
    R(y) = ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
    R(y) = -1                                |y| > L_max

Use it beside the task's reward (its value adds to it), with L_max = max_completion_length. DAPO pairs
it with `mask_truncated_completions=True` for the completions that were cut. TRL's name and semantics
(`trl.rewards.get_soft_overlong_punishment`).
"""

from __future__ import annotations

from asyncgrpo.errors import ConfigurationError


class SoftOverlongPunishment:
    """A reward function (picklable: the rollout worker is a spawned process); metrics name it
    `soft_overlong_punishment_reward`, as TRL's."""

    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        if max_completion_len < 1 or not 0 <= soft_punish_cache <= max_completion_len:
            raise ConfigurationError(
                f"need max_completion_len >= 1 and 0 <= soft_punish_cache <= max_completion_len, got "
                f"{max_completion_len} and {soft_punish_cache}"
            )
        self.max_completion_len = max_completion_len
        self.soft_punish_cache = soft_punish_cache

    def __call__(self, completion_ids: list[list[int]], **kwargs) -> list[float]:
        return [self.reward(len(ids)) for ids in completion_ids]

    def reward(self, length: int) -> float:
        start = self.max_completion_len - self.soft_punish_cache
        if length <= start:
            return 0.0
        if length <= self.max_completion_len:
            return (start - length) / self.soft_punish_cache
        return -1.0


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> SoftOverlongPunishment:
    """DAPO's soft overlong punishment as a reward function (TRL's name): 0 up to max_completion_len -
    soft_punish_cache tokens, then falling linearly to -1 at max_completion_len, -1 beyond."""
    return SoftOverlongPunishment(max_completion_len, soft_punish_cache)
