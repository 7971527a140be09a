"""The weight-sync interface: prepare (servers keep generating), then apply while they are paused.

Every backend splits a sync in two so that the pause, which stalls generation for everyone, covers
only what must happen while no request runs: the filesystem backend writes safetensors before the
pause and only reloads during it; the NCCL backend broadcasts during it. With several training
processes only the sender (rank 0) talks to the servers; the others take part in `prepare`, where
sharded weights are gathered.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import Any

import torch

from asyncgrpo import timeline
from asyncgrpo.generation.background import BackgroundLoop
from asyncgrpo.generation.client import VLLMClient
from asyncgrpo.models import is_served
from asyncgrpo.sharded import full_tensor


@dataclass
class SyncTimings:
    pause_s: float = 0.0  # waiting for vLLM to pause
    transfer_s: float = 0.0  # preparing and sending the weights
    paused_s: float = 0.0  # the servers stood still: from asking them to pause until they resumed

    @property
    def total_s(self) -> float:
        return self.pause_s + self.transfer_s


class WeightSyncBackend(abc.ABC):
    name: str = "abstract"
    timeout_s: float | None = (
        None  # bound of each server call of a sync (weight_sync_timeout); None: the client's
    )

    def __init__(self, client: VLLMClient | None, loop: BackgroundLoop | None, is_sender: bool = True):
        if is_sender and (client is None or loop is None):
            raise ValueError("the sending process needs a vLLM client and its event loop")
        self.client = client
        self.loop = loop
        self.is_sender = is_sender

    def sync(self, model: torch.nn.Module, version: int) -> SyncTimings:
        """Push `model`'s weights to every server as policy `version`; generation resumes after.
        Every training process calls it at the same step."""
        timings = SyncTimings()
        started = time.perf_counter()
        with timeline.span("prepare"):
            prepared = self.prepare(model, version)
        staged = time.perf_counter()
        timings.transfer_s = staged - started
        if not self.is_sender:
            return timings
        paused = staged
        pause_requested = timeline.now_us()
        try:
            # Frozen requests keep their KV; new ones never reuse older weights' prefixes (policy_cache_salt).
            with timeline.span("pause"):
                self.loop.run(self.client.pause(mode="keep", clear_cache=False, timeout=self.timeout_s))
            paused = time.perf_counter()
            with timeline.span("reload"):
                self.apply(prepared, version)
        finally:
            # Every server is resumed, also when the pause itself failed on some of them: a server
            # left paused would stall every rollout until the worker's timeout.
            with timeline.span("resume"):
                self.loop.run(self.client.resume(timeout=self.timeout_s))
            timeline.interval(
                "paused", pause_requested, timeline.now_us(), lane="generation", process=timeline.SERVERS
            )
        timings.pause_s = paused - staged
        timings.transfer_s += time.perf_counter() - paused
        timings.paused_s = time.perf_counter() - staged
        return timings

    def reconnect(self) -> None:
        """After a server restart: re-establish whatever the backend keeps with the servers."""

    @abc.abstractmethod
    def prepare(self, model: torch.nn.Module, version: int) -> Any:
        """Work that can overlap generation (serializing, staging); on a non-sending process, its
        part of the gather. Returns what `apply` needs."""

    @abc.abstractmethod
    def apply(self, prepared: Any, version: int) -> None:
        """Make the servers run the prepared weights; runs on the sender while they are paused."""

    def close(self) -> None:
        """Release what the backend holds (files, communicators)."""


def serving_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The weights vLLM loads, in Hugging Face checkpoint names and state-dict order, each tensor
    once (a tied `lm_head.weight` is the embedding: vLLM ties it itself), without what
    `freeze_outside_language_model` marked as not served. Under FSDP2 they are
    sharded DTensors: pass each through `full_tensor` on every process, in this order."""
    by_name = dict(model.named_parameters(remove_duplicate=False))
    by_name.update(model.named_buffers(remove_duplicate=False))
    seen: set[int] = set()
    weights = []
    for name in model.state_dict():
        if not is_served(model, name):  # frozen vision tower: the server already holds it
            continue
        tensor = by_name[name]
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        weights.append((name, tensor.detach()))
    return weights


def join_gathers(model: torch.nn.Module) -> None:
    """A non-sending process's part of a sync: every gather, in the sender's order, each result
    dropped at once."""
    for _name, tensor in serving_tensors(model):
        full_tensor(tensor)
