"""A Hugging Face model folder written one safetensors file at a time.

What `from_pretrained` and `vllm serve` load: `model.safetensors`, or `model-0000i-of-0000n.safetensors`
files with `model.safetensors.index.json` naming the file of every tensor, beside the config and the
tokenizer. The files are planned from the tensors' shapes alone (`plan_files`), then filled one after
the other (`write_weights`) by a reader that fetches one file's tensors: whoever writes holds at most
one file's worth (`max_file_bytes`) plus one tensor, whatever the model's size. Each file is written
under a staging name, flushed and renamed, so a folder never holds a half-written file under its
real name (docs/scaling.md, "Exporting a checkpoint").
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from asyncgrpo.run.durable_files import fsync_path, staging_path, write_atomically

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_FILE_BYTES = 4 * 2**30  # what the writer holds at once; 4 GiB files are easy to move
_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of the folder, known before it is read."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def plan_files(specs: list[TensorSpec], max_file_bytes: int) -> list[list[TensorSpec]]:
    """The tensors of each file, in order, each file at most `max_file_bytes` (a larger tensor gets a
    file of its own)."""
    files: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if current and size + spec.nbytes > max_file_bytes:
            files.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current:
        files.append(current)
    return files


def file_names(count: int) -> list[str]:
    """transformers' names for a folder of `count` weight files."""
    if count == 1:
        return [WEIGHTS_FILE]
    return [f"model-{index:05d}-of-{count:05d}.safetensors" for index in range(1, count + 1)]


def write_weights(
    specs: list[TensorSpec],
    read: Callable[[list[TensorSpec]], dict[str, torch.Tensor] | None],
    directory: Path,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    writes: bool = True,
    progress: Callable[[str], None] | None = None,
) -> None:
    """The weight files of `specs` in `directory`, one at a time: `read(file's specs)` returns that
    file's tensors (called on every process, in the same order: for a sharded model it is a gather;
    processes that do not write, `writes=False`, get None). Weight files of an earlier save that the
    new set does not name are removed, as `save_pretrained` does."""
    plan = plan_files(specs, max_file_bytes)
    names = file_names(len(plan))
    for index, (file_specs, name) in enumerate(zip(plan, names), start=1):
        tensors = read(file_specs)
        if writes:
            _write_file(directory / name, {spec.name: tensors[spec.name] for spec in file_specs})
            if progress is not None:
                progress(f"wrote {name} ({index} of {len(plan)})")
        del tensors
    if not writes:
        return
    if len(plan) > 1:
        index = {
            "metadata": {"total_size": sum(spec.nbytes for spec in specs)},
            "weight_map": {spec.name: name for file_specs, name in zip(plan, names) for spec in file_specs},
        }
        write_atomically(directory / INDEX_FILE, json.dumps(index, indent=2))
    for path in directory.iterdir():
        if _WEIGHT_FILE.fullmatch(path.name) and path.name not in names and path.name != INDEX_FILE:
            path.unlink()
        elif path.name == INDEX_FILE and len(plan) == 1:
            path.unlink()
    fsync_path(directory)


def _write_file(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    staging = staging_path(path)
    save_file(
        {name: tensor.contiguous() for name, tensor in tensors.items()}, staging, metadata={"format": "pt"}
    )
    fsync_path(staging)
    os.replace(staging, path)
