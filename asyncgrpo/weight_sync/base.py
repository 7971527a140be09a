"""The weight-sync interface: prepare (servers keep generating), then apply while they are paused.

Every backend splits a sync in two so that the pause, which stalls generation for everyone, covers
only what must happen while no request runs: the filesystem backend writes safetensors before the
pause and only reloads during it; the NCCL backend broadcasts during it.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass

import torch

from asyncgrpo.generation.background import BackgroundLoop
from asyncgrpo.generation.client import VLLMClient


@dataclass
class SyncTimings:
    pause_s: float = 0.0  # waiting for vLLM to pause
    barrier_s: float = 0.0  # waiting for the other training processes
    transfer_s: float = 0.0  # preparing and sending the weights

    @property
    def total_s(self) -> float:
        return self.pause_s + self.barrier_s + self.transfer_s


class WeightSyncBackend(abc.ABC):
    name: str = "abstract"

    def __init__(self, client: VLLMClient, loop: BackgroundLoop):
        self.client = client
        self.loop = loop

    def sync(self, model: torch.nn.Module, version: int) -> SyncTimings:
        """Push `model`'s weights to every server as policy `version`; generation resumes after."""
        timings = SyncTimings()
        started = time.perf_counter()
        self.prepare(model, version)
        prepared = time.perf_counter()
        self.loop.run(self.client.pause(mode="keep"))
        paused = time.perf_counter()
        try:
            self.apply(version)
        finally:
            self.loop.run(self.client.resume())
        timings.pause_s = paused - prepared
        timings.transfer_s = (prepared - started) + (time.perf_counter() - paused)
        return timings

    @abc.abstractmethod
    def prepare(self, model: torch.nn.Module, version: int) -> None:
        """Work that can overlap generation (serializing, staging)."""

    @abc.abstractmethod
    def apply(self, version: int) -> None:
        """Make the servers run the prepared weights; runs while they are paused."""

    def close(self) -> None:
        """Release what the backend holds (files, communicators)."""


def serving_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights vLLM loads, in Hugging Face checkpoint names, each tensor once (a tied
    `lm_head.weight` is the embedding: vLLM ties it itself)."""
    seen: set[int] = set()
    weights = {}
    for name, tensor in model.state_dict().items():
        pointer = tensor.data_ptr()
        if pointer in seen:
            continue
        seen.add(pointer)
        weights[name] = tensor.detach()
    return weights
