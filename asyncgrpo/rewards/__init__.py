"""Reward functions (`from asyncgrpo.rewards import accuracy_reward`, as `trl.rewards`)."""

from asyncgrpo.rewards.accuracy import accuracy_reward
from asyncgrpo.rewards.code_execution import code_execution_reward

__all__ = ["accuracy_reward", "code_execution_reward"]
