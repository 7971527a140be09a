"""Tensors that may be sharded over the training processes (FSDP2 DTensors), read whole."""

from __future__ import annotations

import torch


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a collective over the training processes for a sharded DTensor (all of
    them must call it in the same order), the tensor itself otherwise."""
    gather = getattr(tensor, "full_tensor", None)
    return gather() if gather is not None else tensor
