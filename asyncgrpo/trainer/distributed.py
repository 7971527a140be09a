"""Several training processes (torchrun / accelerate launch): FSDP2 sharding and the few
collectives the training loop needs. Everything that crosses processes in the trainer goes
through here (the weight broadcast to vLLM lives in `weight_sync/`).

Rank 0 owns the rollout worker, the vLLM client and the prompt ledger; it decides each step's batch
and broadcasts it, so every rank packs the same rows and trains on its own. With one process every
call here is a no-op.
"""

from __future__ import annotations

import types
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from asyncgrpo.losses.token_logprobs import PACKED_FORWARD_METHOD, packed_forward
from asyncgrpo.modeling.sharded import full_tensor

T = TypeVar("T")


class Processes:
    def __init__(self, world_size: int, rank: int):
        self.world_size = world_size
        self.rank = rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def broadcast(self, value: T | None) -> T:
        """Rank 0's `value` on every rank (others pass None)."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, device=_collective_device())
        return box[0]

    def gather(self, value: T) -> list[T]:
        """Every rank's `value`, in rank order, on every rank."""
        if not self.distributed:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values


def _collective_device() -> torch.device | None:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


def shard_model(model: torch.nn.Module, reshard_after_forward: bool = True) -> None:
    """FSDP2 over all processes: each decoder layer its own unit (gathered one at a time), the
    rest (embeddings, final norm, head) in the root unit. The packed forward, which calls the decoder
    and reads the head's weight directly rather than through `model.forward`, is registered as a
    forward method of the root so that FSDP2 gathers the root's parameters around it and reduces
    their gradients."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    for layer in model.get_decoder().layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    setattr(model, PACKED_FORWARD_METHOD, types.MethodType(packed_forward, model))
    register_fsdp_forward_method(model, PACKED_FORWARD_METHOD)


def local_value(value: torch.Tensor | float) -> float:
    """A scalar that may be a DTensor (e.g. a grad norm of sharded gradients) as a float."""
    return float(full_tensor(value)) if isinstance(value, torch.Tensor) else float(value)


def full_state(model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
    """The whole model and optimizer states on CPU (a collective: every rank calls it), in the
    unsharded layout a checkpoint is written in."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(
        model, optimizer, options=options
    )


def full_model_state(model: torch.nn.Module, sharded: bool) -> dict[str, torch.Tensor]:
    """The whole model state on CPU (sharded: a collective, every rank calls it)."""
    if not sharded:
        return {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor], sharded: bool) -> None:
    """Load a whole (unsharded) model state, into the shards when `sharded` (every rank calls it)."""
    if not sharded:
        model.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def load_optimizer_state(model: torch.nn.Module, optimizer, state: dict) -> None:
    """Load a full (unsharded) optimizer state into the sharded optimizer; every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
