"""Reward functions (`from asyncgrpo.rewards import accuracy_reward`, as `trl.rewards`)."""

from asyncgrpo.rewards.accuracy import accuracy_reward

__all__ = ["accuracy_reward"]
