"""Pushing the trainer's weights to the vLLM servers: backends behind one small interface."""

from asyncgrpo.weight_sync.base import SyncTimings, WeightSyncBackend
from asyncgrpo.weight_sync.filesystem import FilesystemWeightSync
from asyncgrpo.weight_sync.lora import LoraAdapterSync
from asyncgrpo.weight_sync.nccl import NcclWeightSync


def non_sending_weight_sync(backend: str) -> WeightSyncBackend:
    """The backend of a training process other than rank 0: it only takes part in the gathers."""
    if backend == FilesystemWeightSync.name:
        return FilesystemWeightSync(None, None, None, is_sender=False)
    if backend == LoraAdapterSync.name:
        return LoraAdapterSync(None, None, None, keep=1, is_sender=False)
    if backend == NcclWeightSync.name:
        return NcclWeightSync(None, None, None, timeout_s=0, is_sender=False)
    raise ValueError(f"unknown weight-sync backend {backend!r}")


__all__ = ["FilesystemWeightSync", "LoraAdapterSync", "NcclWeightSync", "SyncTimings", "WeightSyncBackend", "non_sending_weight_sync"]
