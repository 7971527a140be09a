"""`asyncgrpo export CHECKPOINT OUT_DIR`: a checkpoint as a Hugging Face folder to serve or share.

A sharded checkpoint becomes a consolidated folder: the config, generation config and tokenizer rank
0 wrote, and the weights read from every rank's shards one safetensors file at a time
(checkpoints/hf_folder.py), so this process holds one file's worth, never the whole model. A PEFT
run's checkpoint becomes the adapter (`adapter_model.safetensors` and `adapter_config.json`), which
`PeftModel.from_pretrained` and `vllm serve BASE --enable-lora --lora-modules NAME=OUT_DIR` load. A
full-layout checkpoint already is such a folder: its model, config and tokenizer files are copied.
The run's own files (trainer and rollout states, optimizer, RNG) stay behind. The folder is written
under a staging name and renamed when complete (docs/scaling.md, "Exporting a checkpoint").
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from asyncgrpo.checkpoints.hf_folder import DEFAULT_MAX_FILE_BYTES, TensorSpec, write_weights
from asyncgrpo.checkpoints.layout import MANIFEST_FILE, SHARDS_DIR, ShardedManifest, is_sharded
from asyncgrpo.checkpoints.sharded_state import model_tensor_shapes, read_model_tensors
from asyncgrpo.run.durable_files import publish_directory, staging_path

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# What a checkpoint holds for resuming a run, not for serving it (the loss menu's state and reference
# model included: trainer/algorithm_state.py; a weight file beside the model's would be loaded with it).
_RUN_FILES = re.compile(
    r"trainer_state\.json|rollout_state\.json|held_samples\.(npz|json)|(optimizer|scheduler|scaler)\.pt"
    r"|rng_state(_\d+)?\.pth|training_args\.bin|algorithm_state\.json|reference_model\.safetensors|"
    + re.escape(MANIFEST_FILE)
)
_SHARDED_WEIGHT_FILES = re.compile(
    r"model.*\.safetensors(\.index\.json)?|pytorch_model.*\.bin(\.index\.json)?"
)


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write `checkpoint` as a Hugging Face folder at `out_dir` (new or empty); returns it."""
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"{checkpoint} is not a directory: give a checkpoint-N directory of a run")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(
            f"{out_dir} exists and is not an empty directory: give a new directory to export to"
        )
    staging = staging_path(out_dir.resolve())
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        if is_sharded(checkpoint):
            _export_sharded(checkpoint, staging, max_file_bytes, progress)
        else:
            _copy_files(checkpoint, staging, serving_only=False)
        publish_directory(staging, out_dir.resolve())
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _export_sharded(checkpoint: Path, out: Path, max_file_bytes: int, progress) -> None:
    manifest = ShardedManifest.load(checkpoint)
    _copy_files(checkpoint, out, serving_only=True)
    shapes = model_tensor_shapes(checkpoint)
    if manifest.peft_adapter is not None:
        adapter = read_model_tensors(checkpoint, shapes)  # the adapter alone: small
        save_file(
            {
                adapter_file_name(name, manifest.peft_adapter): tensor.contiguous()
                for name, tensor in adapter.items()
            },
            out / ADAPTER_WEIGHTS_FILE,
            metadata={"format": "pt"},
        )
        return
    specs = [TensorSpec(name, tuple(size), dtype) for name, (size, dtype) in shapes.items()]

    def read(file_specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
        return read_model_tensors(checkpoint, {spec.name: (spec.shape, spec.dtype) for spec in file_specs})

    write_weights(specs, read, out, max_file_bytes, progress=progress)


def adapter_file_name(name: str, adapter: str) -> str:
    """The name PEFT saves a trained parameter under: its module path without the adapter's name
    (`...q_proj.lora_A.default.weight` -> `...q_proj.lora_A.weight`)."""
    return ".".join(part for part in name.split(".") if part != adapter)


def _copy_files(checkpoint: Path, out: Path, serving_only: bool) -> None:
    """The checkpoint's files but the run's own (and, `serving_only`, but model weights: a sharded
    checkpoint's are in its shards)."""
    for path in sorted(checkpoint.iterdir()):
        if path.name == SHARDS_DIR or _RUN_FILES.fullmatch(path.name):
            continue
        if serving_only and _SHARDED_WEIGHT_FILES.fullmatch(path.name):
            continue
        if path.is_dir():
            shutil.copytree(path, out / path.name)
        else:
            shutil.copyfile(path, out / path.name)
