"""What a weight sync sends, and the merged sync of a PEFT model (`sync_policy`).

Merged sync: the adapter merged into the base weights, sent under the base names through the
ordinary backend (filesystem or NCCL).

`merged_for_serving(peft_model)` merges the adapter in place, yields a view whose parameters carry
the Hugging Face names vLLM loads (`...q_proj.weight`, not `...q_proj.base_layer.weight`; adapter
tensors left out), and afterwards puts every merged base weight back from a copy taken before the
merge. Unmerging alone (W + BA - BA) would leave rounding drift in the frozen base that grows with
every sync; restoring the copy leaves the model bit-for-bit as it was. The copies are kept on the
CPU so that a sync does not need a second copy of the targeted weights in accelerator memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from asyncgrpo.modeling.models import is_served
from asyncgrpo.modeling.peft_adapters import is_peft_model
from asyncgrpo.weight_sync.base import SyncTimings, WeightSyncBackend, serving_tensors
from asyncgrpo.weight_sync.buckets import tensor_bytes
from asyncgrpo.weight_sync.lora import LoraAdapterSync

# Module names PEFT adds around or beside a wrapped layer; their tensors are not served.
_ADAPTER_SEGMENTS = frozenset(
    {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector", "original_module"}
)


def served_name(name: str, adapter_name: str) -> str | None:
    """The served (Hugging Face) name of a base-model state-dict entry of a PEFT model; None for
    the adapter's own tensors."""
    parts = name.split(".")
    if _ADAPTER_SEGMENTS.intersection(parts):
        return None
    kept = []
    index = 0
    while index < len(parts):
        if parts[index] == "base_layer":
            index += 1
            continue
        if parts[index] == "modules_to_save" and index + 1 < len(parts) and parts[index + 1] == adapter_name:
            index += 2  # the trained copy of a whole module is served in its place
            continue
        kept.append(parts[index])
        index += 1
    return ".".join(kept)


class ServedWeights:
    """Duck-types the three methods `serving_tensors` reads, with the served names."""

    def __init__(self, peft_model):
        base = peft_model.get_base_model()
        adapter = peft_model.active_adapter
        tensors = dict(base.named_parameters(remove_duplicate=False))
        tensors.update(base.named_buffers(remove_duplicate=False))
        self._tensors: dict[str, torch.Tensor] = {}
        for name in base.state_dict():
            served = served_name(name, adapter)
            if served is not None and name in tensors and is_served(base, served):
                self._tensors[served] = tensors[name]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self._tensors)

    def named_parameters(self, remove_duplicate: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._tensors.items())

    def named_buffers(self, remove_duplicate: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(())


def _merged_layers(peft_model) -> list[torch.nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [module for module in peft_model.modules() if isinstance(module, BaseTunerLayer)]


@contextmanager
def merged_for_serving(peft_model) -> Iterator[ServedWeights]:
    layers = _merged_layers(peft_model)
    saved = []
    with torch.no_grad():
        for layer in layers:
            weight = layer.get_base_layer().weight
            local = weight.to_local() if hasattr(weight, "to_local") else weight
            saved.append((local, local.detach().to("cpu", copy=True)))
        peft_model.merge_adapter()
    try:
        yield ServedWeights(peft_model)
    finally:
        with torch.no_grad():
            peft_model.unmerge_adapter()  # PEFT's own bookkeeping of what is merged
            for local, copy in saved:
                local.copy_(copy)


def sync_policy(
    backend: WeightSyncBackend, model: torch.nn.Module, version: int, urls: list[str] | None = None
) -> tuple[SyncTimings, int]:
    """One weight sync of `model` as policy `version` to `urls` (default: the client's servers), in the
    form `backend` sends: the adapter alone, the merged weights of a PEFT model, or the model's own
    weights. Returns the timings and the bytes sent (`perf/weight_sync_bytes`: what adapter-only sync
    saves)."""
    if isinstance(backend, LoraAdapterSync):
        timings, sent = backend.sync(model, version, urls), backend.payload_tensors(model)
    elif is_peft_model(model):
        with merged_for_serving(model) as merged:
            timings, sent = backend.sync(merged, version, urls), serving_tensors(merged)
    else:
        timings, sent = backend.sync(model, version, urls), serving_tensors(model)
    return timings, sum(tensor_bytes(tensor.shape, tensor.dtype) for _, tensor in sent)
