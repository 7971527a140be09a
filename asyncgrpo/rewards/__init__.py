"""Reward functions (`from asyncgrpo.rewards import accuracy_reward`, as `trl.rewards`)."""

from asyncgrpo.rewards.accuracy import accuracy_reward
from asyncgrpo.rewards.code_execution import code_execution_reward
from asyncgrpo.rewards.overlong import SoftOverlongPunishment, get_soft_overlong_punishment

__all__ = [
    "SoftOverlongPunishment",
    "accuracy_reward",
    "code_execution_reward",
    "get_soft_overlong_punishment",
]
