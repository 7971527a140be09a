"""Pushing the trainer's weights to the vLLM servers: backends behind one small interface."""

from asyncgrpo.weight_sync.base import SyncTimings, WeightSyncBackend

__all__ = ["SyncTimings", "WeightSyncBackend"]
