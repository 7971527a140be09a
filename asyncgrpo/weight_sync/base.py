"""The weight-sync interface: prepare (servers keep generating), then apply while they are paused.

Every backend splits a sync in two so that the pause, which stalls generation for everyone, covers
only what must happen while no request runs: the filesystem backend writes safetensors before the
pause and only reloads during it; the NCCL backend broadcasts during it. With several training
processes only the sender (rank 0) talks to the servers; the others take part in `prepare`, where
sharded weights are gathered.

A sync goes to the servers the trainer counts live (trainer/server_roster.py). One it cannot reach is
skipped and named in the timings (`missed`), never waited for beyond the call's deadline: the trainer
counts it lost and gives it the weights when it answers again (`resend`, or a full sync).
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncgrpo.generation.background import BackgroundLoop
from asyncgrpo.generation.client import VLLMClient
from asyncgrpo.modeling.models import is_served
from asyncgrpo.modeling.sharded import full_tensor
from asyncgrpo.run import timeline


@dataclass
class SyncTimings:
    pause_s: float = 0.0  # waiting for vLLM to pause
    transfer_s: float = 0.0  # preparing and sending the weights
    paused_s: float = 0.0  # the servers stood still: from asking them to pause until they resumed
    missed: list[str] = field(default_factory=list)  # servers this version did not reach

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

    # Whether `resend` can give a server the version the others run without the model (the backend
    # kept what it sent); otherwise a server that needs the weights again gets a full sync.
    can_resend: bool = False

    def sync(self, model: torch.nn.Module, version: int, urls: list[str] | None = None) -> SyncTimings:
        """Push `model`'s weights to the servers (`urls`, default the client's) as policy `version`;
        generation resumes after. Every training process calls it at the same step."""
        timings = SyncTimings()
        started = time.perf_counter()
        with timeline.span("prepare"):
            prepared = self.prepare(model, version)
        timings.transfer_s = time.perf_counter() - started
        if self.is_sender:
            self._apply_paused(prepared, version, self.client.base_urls if urls is None else urls, timings)
        return timings

    def resend(self, version: int, urls: list[str]) -> list[str]:
        """Give `urls` (servers back after a loss, or new) the version `version` the others run,
        from what the backend kept of it (`can_resend`); returns the servers it did not reach."""
        raise NotImplementedError(f"the {self.name} weight sync cannot resend a version")

    def _apply_paused(self, prepared: Any, version: int, urls: list[str], timings: SyncTimings) -> None:
        """Pause `urls`, `apply`, resume them: the part of a sync during which the servers stand still."""
        staged = paused_at = time.perf_counter()
        pause_requested = timeline.now_us()
        paused = list(urls)  # resumed in the end, even when the pause itself failed on some of them
        try:
            # Frozen requests keep their KV; new ones never reuse older weights' prefixes (policy_cache_salt).
            with timeline.span("pause"):
                timings.missed = self.loop.run(
                    self.client.pause(mode="keep", clear_cache=False, timeout=self.timeout_s, urls=urls)
                )
            paused = [url for url in urls if url not in timings.missed]
            paused_at = time.perf_counter()
            with timeline.span("reload"):
                missed = self.apply(prepared, version, paused)
            timings.missed += missed
            paused = [url for url in paused if url not in missed]  # a server left paused: see `apply`
        finally:
            # A server left paused would stall every rollout sent to it until the worker's timeout.
            with timeline.span("resume"):
                lost = self.loop.run(self.client.resume(timeout=self.timeout_s, urls=paused))
            timings.missed += [url for url in lost if url not in timings.missed]
            timeline.interval(
                "paused", pause_requested, timeline.now_us(), lane="generation", process=timeline.SERVERS
            )
        timings.pause_s = paused_at - staged
        timings.transfer_s += time.perf_counter() - paused_at
        timings.paused_s = time.perf_counter() - staged

    def reconnect(self) -> None:
        """Before servers that restarted or are new get the weights: re-establish whatever the backend
        keeps with the servers."""

    @abc.abstractmethod
    def prepare(self, model: torch.nn.Module, version: int) -> Any:
        """Work that can overlap generation (serializing, staging); on a non-sending process, its
        part of the gather. Returns what `apply` needs."""

    @abc.abstractmethod
    def apply(self, prepared: Any, version: int, urls: list[str]) -> list[str]:
        """Make the servers `urls` run the prepared weights; runs on the sender while they are paused.
        Returns the servers that did not get them: those are not resumed (one may hold part of them)
        and the trainer counts them lost."""

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
