"""A model sharded over the training processes, saved as a consolidated Hugging Face folder.

`save_model` at the end of a run with several processes: every process takes part in gathering each
tensor in turn (`full_tensor`, a collective), and the writer keeps the gathered tensors of one
safetensors file at a time (checkpoints/hf_folder.py), so no process holds the whole model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from asyncgrpo.checkpoints.hf_folder import DEFAULT_MAX_FILE_BYTES, TensorSpec, write_weights
from asyncgrpo.modeling.sharded import full_tensor


def is_sharded_module(model: torch.nn.Module) -> bool:
    """Whether the parameters are sharded over several processes (FSDP2's DTensors)."""
    return any(hasattr(parameter, "full_tensor") for parameter in model.parameters())


def consolidated_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{name: tensor} of what `save_pretrained` writes, in state-dict order: parameters and persistent
    buffers, a tensor reachable by two names (tied embeddings) once, under its first."""
    by_name = dict(model.named_parameters(remove_duplicate=False))
    by_name.update(model.named_buffers(remove_duplicate=False))
    seen: set[int] = set()
    tensors = {}
    for name in model.state_dict():
        tensor = by_name.get(name)
        if tensor is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        tensors[name] = tensor.detach()
    return tensors


def save_consolidated(
    model: torch.nn.Module, directory: Path, writes: bool, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
) -> None:
    """The weight files of `model` in `directory` (every process calls it; `writes`: this one writes
    them, the others only take part in the gathers)."""
    tensors = consolidated_tensors(model)
    specs = [TensorSpec(name, tuple(tensor.shape), tensor.dtype) for name, tensor in tensors.items()]

    def read(file_specs: list[TensorSpec]) -> dict[str, torch.Tensor] | None:
        gathered = {} if writes else None
        for spec in file_specs:
            whole = full_tensor(tensors[spec.name]).to("cpu")
            if gathered is not None:
                gathered[spec.name] = whole
        return gathered

    write_weights(specs, read, directory, max_file_bytes, writes=writes)
