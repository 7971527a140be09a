"""Filesystem weight sync: safetensors under `<output_dir>/.vllm_weights/`, reloaded by the servers.

Works everywhere vLLM runs (CPU included) and across nodes that share a filesystem. Each version
goes to its own directory, written completely before the servers are told about it; the previous
version's directory is removed once the servers have moved on. Paths sent to the servers are
absolute: a server resolves a relative one against its own working directory. A directory a reload
may still be reading (the sync was interrupted) is never removed; the next run clears it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from asyncgrpo.generation.client import policy_label
from asyncgrpo.modeling.sharded import full_tensor
from asyncgrpo.weight_sync.base import SyncTimings, WeightSyncBackend, join_gathers, serving_tensors


class FilesystemWeightSync(WeightSyncBackend):
    name = "filesystem"

    def __init__(
        self,
        client,
        loop,
        directory: str | os.PathLike | None,
        is_sender: bool = True,
        timeout_s: float | None = None,
    ):
        super().__init__(client, loop, is_sender)
        self.timeout_s = timeout_s
        self.directory = Path(directory).resolve() if directory is not None else None
        if is_sender:
            shutil.rmtree(self.directory, ignore_errors=True)  # versions a previous run left behind
            self.directory.mkdir(parents=True, exist_ok=True)
        self._current: Path | None = None
        self._reloading: Path | None = None

    def prepare(self, model: torch.nn.Module, version: int) -> Path | None:
        if not self.is_sender:
            join_gathers(model)
            return None
        target = self.directory / f"v{version}"
        staging = self.directory / f".v{version}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        tensors = {
            name: full_tensor(tensor).to("cpu").contiguous() for name, tensor in serving_tensors(model)
        }
        save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)  # a reader never sees a half-written version
        return target

    can_resend = True  # the served version's files stay until the next one replaces them

    def apply(self, prepared: Path, version: int, urls: list[str]) -> list[str]:
        self._reloading = prepared
        missed = self.loop.run(
            self.client.reload_weights(
                str(prepared), version=policy_label(version), timeout=self.timeout_s, urls=urls
            )
        )
        self._reloading = None
        previous, self._current = self._current, prepared
        if previous is not None and previous != self._current:
            shutil.rmtree(previous, ignore_errors=True)
        return missed

    def resend(self, version: int, urls: list[str]) -> list[str]:
        timings = SyncTimings()
        self._apply_paused(self._current, version, urls, timings)
        return timings.missed

    def close(self) -> None:
        if self.directory is None:
            return
        if self._reloading is None:
            shutil.rmtree(self.directory, ignore_errors=True)
            return
        for child in self.directory.iterdir():  # a server may still be reading `_reloading`
            if child != self._reloading:
                shutil.rmtree(child, ignore_errors=True)
