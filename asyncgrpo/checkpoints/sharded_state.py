"""The model and optimizer state a sharded checkpoint holds, and reading it back on any number of
processes.

`training_state` is what torch.distributed.checkpoint (DCP) writes: each process's own shards (the
local pieces of FSDP2's DTensors; the whole tensors on one process), keyed by parameter name, so that
no process ever holds more than its own part. DCP records where every piece of every tensor lies,
which is what lets `load_training_state` read a checkpoint of N processes into M: each reads the
pieces of its own shards from whichever files hold them (docs/scaling.md, "Checkpoints").

A parameter shared under two names (tied embeddings) is written once, under its first name: the
optimizer holds one state for it too.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from asyncgrpo.checkpoints.layout import MODEL_KEY, OPTIMIZER_KEY, SHARDS_DIR, ShardedManifest
from asyncgrpo.errors import ConfigurationError

logger = logging.getLogger(__name__)


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{name: the first name of the same parameter} for each parameter reachable by several names."""
    first: dict[int, str] = {}
    aliases = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            aliases[name] = first[id(parameter)]
        else:
            first[id(parameter)] = name
    return aliases


def training_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, trainable_only: bool
) -> dict:
    """{"model": {name: tensor}, "optim": optimizer state by parameter name} as this process holds it
    (sharded DTensors under FSDP2). `trainable_only`: a PEFT run, whose frozen base comes from the
    model id again and is not written. The tensors are the live ones, not copies. `optimizer`: the
    torch optimizer itself (not accelerate's wrapper); None leaves it out. An optimizer without
    state yet gets it (a zero-rate step), so the same call builds what a resume reads into."""
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    state = {MODEL_KEY: get_model_state_dict(model, options=options)}
    if optimizer is not None:
        state[OPTIMIZER_KEY] = get_optimizer_state_dict(model, optimizer, options=options)
    for alias in tied_aliases(model):
        state[MODEL_KEY].pop(alias, None)
        if optimizer is not None:
            state[OPTIMIZER_KEY]["state"].pop(alias, None)
            for group in state[OPTIMIZER_KEY]["param_groups"]:
                group["params"] = [name for name in group["params"] if name != alias]
    return state


def load_training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    checkpoint: str | Path,
    manifest: ShardedManifest,
    distributed: bool,
) -> bool:
    """Read the checkpoint's shards into `model` (and `optimizer`), whatever the number of processes
    that wrote them and that read them now (every process calls it; `distributed`: a process group
    is formed). Returns whether the optimizer state was restored (False when the checkpoint holds
    none: save_only_model)."""
    with_optimizer = optimizer is not None and manifest.holds_optimizer
    state = training_state(model, optimizer if with_optimizer else None, manifest.peft_adapter is not None)
    try:
        dcp.load(state, checkpoint_id=str(Path(checkpoint) / SHARDS_DIR), no_dist=not distributed)
    except (Exception, CheckpointException) as error:  # DCP's exception is a BaseException
        adapter = "a PEFT adapter" if manifest.peft_adapter else "a whole model (no PEFT adapter)"
        raise ConfigurationError(
            f"{checkpoint}: its shards do not fit the model being trained ({error}). It holds {adapter} "
            f"in {manifest.dtype}: resume with the model and peft_config it was written with"
        ) from error
    # DCP read into the live tensors; the setters apply what they do beyond that (FSDP's views).
    set_model_state_dict(model, state[MODEL_KEY], options=StateDictOptions(strict=False))
    if with_optimizer:
        set_optimizer_state_dict(model, optimizer, state[OPTIMIZER_KEY])
    return with_optimizer


def read_model_tensors(checkpoint: str | Path, shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> dict:
    """The whole tensors `shapes` names (model parameter names), read from a sharded checkpoint by
    this process alone (no process group): the pieces every rank wrote, put together. Only these
    tensors are held in memory."""
    template = {MODEL_KEY: {name: torch.empty(size, dtype=dtype) for name, (size, dtype) in shapes.items()}}
    dcp.load(template, checkpoint_id=str(Path(checkpoint) / SHARDS_DIR), no_dist=True)
    return template[MODEL_KEY]


def model_tensor_shapes(checkpoint: str | Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """{parameter name: (shape, dtype)} of the model tensors a sharded checkpoint holds, in the
    order they were written, from its metadata alone."""
    metadata = dcp.FileSystemReader(str(Path(checkpoint) / SHARDS_DIR)).read_metadata()
    prefix = f"{MODEL_KEY}."
    return {
        key.removeprefix(prefix): (entry.size, entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and hasattr(entry, "size")
    }
