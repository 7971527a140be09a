"""Adapter-only weight sync: the servers (`--enable-lora`) load each policy version's LoRA adapter.

Each version is written under `<output_dir>/.vllm_lora/v<N>` (staged and renamed, so a server never
reads half an adapter) and loaded on every server as `policy_adapter_name(prefix, N)`; each request
goes to the adapter of the version current when its rollout started. The newest `max_staleness + 1`
versions stay loaded (hence `--max-loras >= max_staleness + 2`), and loading never pauses generation.
The prefix is unique to each run, so a server that outlived an earlier run never mixes that run's
adapters with this one's. How and why: docs/peft.md#adapter-only-sync.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections import deque
from pathlib import Path

import torch
from safetensors.torch import save_file

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.generation.client import VLLMRequestError, policy_adapter_name, policy_label
from asyncgrpo.generation.server import SERVABLE_LORA_RANKS, serving_lora_rank
from asyncgrpo.generation.server_info import ServerInfo
from asyncgrpo.modeling.peft_adapters import (
    active_config,
    adapter_rank,
    adapter_tensors,
    adapter_unservable_reason,
)
from asyncgrpo.weight_sync.base import SyncTimings, WeightSyncBackend, full_tensor

logger = logging.getLogger(__name__)


def server_flags(rank: int, max_staleness: int) -> str:
    return f"--enable-lora --max-lora-rank {serving_lora_rank(rank)} --max-loras {max_staleness + 2}"


def check_lora_server(max_rank: int, max_loras: int, url: str, rank: int, max_staleness: int) -> None:
    """Raise a ValueError naming the flags to restart `url` with when its LoRA settings
    (`--max-lora-rank`, `--max-loras`) cannot hold `max_staleness + 1` adapters of `rank` plus the
    one being loaded."""
    problems = []
    if max_rank not in SERVABLE_LORA_RANKS:
        problems.append(f"--max-lora-rank {max_rank} is not one of vLLM's values {SERVABLE_LORA_RANKS}")
    elif max_rank < rank:
        problems.append(f"--max-lora-rank {max_rank} is below the adapter's rank r={rank}")
    if max_loras < max_staleness + 2:
        problems.append(
            f"--max-loras {max_loras} is below max_staleness + 2 = {max_staleness + 2} (max_staleness + 1 "
            "versions stay loaded, and each sync loads the next one before unloading the oldest)"
        )
    if problems:
        raise ConfigurationError(
            f"the vLLM server at {url} runs with --enable-lora, but "
            + "; ".join(problems)
            + ". Restart it with "
            "`VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 vllm serve ... "
            f"{server_flags(rank, max_staleness)}` (`asyncgrpo serve MODEL --enable-lora --lora-rank {rank} "
            f"--max-staleness {max_staleness}` picks them), or "
            "without --enable-lora to sync merged weights instead."
        )


class LoraAdapterSync(WeightSyncBackend):
    name = "lora"

    def __init__(self, client, loop, directory: str | os.PathLike | None, keep: int, is_sender: bool = True):
        super().__init__(client, loop, is_sender)
        if keep < 1:
            raise ValueError(f"keep={keep}: at least the newest adapter must stay loaded")
        self.directory = Path(directory).absolute() if directory is not None else None
        self.keep = keep
        self.prefix = f"asyncgrpo-{uuid.uuid4().hex[:8]}"
        self.loaded: deque[tuple[int, Path]] = deque()  # (version, folder), oldest first
        if is_sender:
            self.directory.mkdir(parents=True, exist_ok=True)

    can_resend = True  # the newest adapter's folder stays while it is loaded

    def sync(self, model: torch.nn.Module, version: int, urls: list[str] | None = None) -> SyncTimings:
        started = time.perf_counter()
        prepared = self.prepare(model, version)
        missed = (
            self.apply(prepared, version, self.client.base_urls if urls is None else urls)
            if self.is_sender
            else []
        )
        return SyncTimings(transfer_s=time.perf_counter() - started, missed=missed)

    def resend(self, version: int, urls: list[str]) -> list[str]:
        return self.apply(self.loaded[-1][1], version, urls)

    def prepare(self, model: torch.nn.Module, version: int) -> Path | None:
        tensors = {name: full_tensor(tensor) for name, tensor in adapter_tensors(model)}
        if not self.is_sender:
            return None
        from peft.utils import get_peft_model_state_dict  # peft is an optional extra

        target = self.directory / f"v{version}"
        staging = self.directory / f".v{version}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        state = get_peft_model_state_dict(model, state_dict=tensors, adapter_name=model.active_adapter)
        save_file(
            {name: t.to("cpu").contiguous() for name, t in state.items()},
            staging / "adapter_model.safetensors",
        )
        active_config(model).save_pretrained(str(staging))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
        return target

    def apply(self, prepared: Path, version: int, urls: list[str]) -> list[str]:
        # The same version again: pushed to a server back from a restart, which lost its adapters.
        # Loading in place gives it the adapter and leaves the others serving the same weights.
        again = bool(self.loaded) and self.loaded[-1][0] == version
        name = policy_adapter_name(self.prefix, version)
        missed = self.loop.run(
            self.client.load_lora_adapter(name, str(prepared), load_inplace=again, urls=urls)
        )
        # The label the trainer checks to detect restarted servers (the base weights never change).
        reached = [url for url in urls if url not in missed]
        missed += self.loop.run(self.client.set_weight_label(policy_label(version), urls=reached))
        if not again:
            self.loaded.append((version, prepared))
        while len(self.loaded) > self.keep:
            self._retire(*self.loaded.popleft())
        return missed

    def _retire(self, version: int, folder: Path) -> None:
        try:  # a server that cannot be reached is skipped: the trainer counts it lost
            self.loop.run(self.client.unload_lora_adapter(policy_adapter_name(self.prefix, version)))
        except VLLMRequestError as error:
            if error.status != 404:  # 404: a server that joined or restarted since then never had it
                raise
        shutil.rmtree(folder, ignore_errors=True)

    def payload_tensors(self, model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        return adapter_tensors(model)

    def close(self) -> None:
        if not self.is_sender:
            return
        while self.loaded:
            version, folder = self.loaded.popleft()
            try:
                self._retire(version, folder)
            except Exception as error:  # shutting down: the server may be gone already
                logger.warning("could not unload adapter version %d: %s", version, error)
        shutil.rmtree(self.directory, ignore_errors=True)


def adapter_sync_for(
    peft_model, info: ServerInfo | None, client, loop, output_dir: str | os.PathLike, max_staleness: int
) -> LoraAdapterSync | None:
    """The adapter-only backend when the servers run with `--enable-lora` (`info`, what the first
    one reports; every server of a run is started alike) and vLLM can serve the adapter; None when
    the merged weights must be sent instead, with a warning saying why when the servers were
    started for adapters. Raises when their LoRA flags are too small."""
    if info is None or not info.lora_enabled:
        return None
    merged = "weight sync falls back to sending the merged weights"
    reason = adapter_unservable_reason(peft_model)
    rank = adapter_rank(peft_model)
    if reason is None and serving_lora_rank(rank) is None:
        reason = f"its rank r={rank} is above vLLM's largest --max-lora-rank {SERVABLE_LORA_RANKS[-1]}"
    if reason is not None:
        logger.warning(
            "the vLLM servers run with --enable-lora, but the adapter cannot be served as one: %s; %s",
            reason,
            merged,
        )
        return None
    check_lora_server(
        int(info.max_lora_rank or 0), int(info.max_loras or 0), client.base_urls[0], rank, max_staleness
    )
    logger.info("weight sync: LoRA adapter only (r=%d, %d versions kept loaded)", rank, max_staleness + 1)
    return LoraAdapterSync(client, loop, Path(output_dir).resolve() / ".vllm_lora", keep=max_staleness + 1)
