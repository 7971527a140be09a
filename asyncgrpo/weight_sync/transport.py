"""The data plane of the NCCL weight sync: how the trainer (rank 0) meets the vLLM workers and
broadcasts bytes to them. The protocol around it (HTTP calls, order, buckets) is in `nccl.py`.

The rendezvous (vLLM >= 0.30): the trainer mints an `ncclUniqueId` and sends it, base64, in the
init payload of the authenticated HTTP call; no extra port, no store. (Older servers joined through a
TCP store the trainer hosted, holding a pickle they unpickled: open to anyone who reached it, so it
is not offered: docs/security.md.) The workers issue a one-element float32 all-reduce right after
joining, so the trainer must issue the matching one before anything else.
"""

from __future__ import annotations

import base64
from typing import Protocol

import torch

from asyncgrpo.errors import WeightSyncError
from asyncgrpo.weight_sync.nccl_library import NcclCommunicator, NcclLibrary


class BroadcastTransport(Protocol):
    """Rank 0's side of a broadcast group with the servers' workers."""

    device: torch.device

    def rendezvous_fields(self, server_host: str) -> dict:
        """The `init_info` fields that tell the workers how to join (called before `join`)."""

    def join(self, world_size: int, timeout_s: float) -> None:
        """Join as rank 0 of `world_size` ranks and run the warm-up all-reduce; returns once every
        rank has joined."""

    def broadcast(self, buffer: torch.Tensor, timeout_s: float) -> None:
        """Send `buffer` (on `device`) to every rank; returns once it has been sent."""

    def abort(self) -> None:
        """Tear the group down after a failure, without waiting for peers."""

    def close(self) -> None: ...


class NcclTransport:
    def __init__(self, library: NcclLibrary | None = None):
        if not torch.cuda.is_available():
            raise WeightSyncError(
                "NCCL weight sync needs a CUDA GPU on the trainer; use weight_sync_backend='filesystem'"
            )
        self.library = library or NcclLibrary()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._unique_id: bytes | None = None
        self._communicator: NcclCommunicator | None = None

    def rendezvous_fields(self, server_host: str) -> dict:
        self._unique_id = self.library.new_unique_id()
        return {"nccl_unique_id_b64": base64.b64encode(self._unique_id).decode()}

    def join(self, world_size: int, timeout_s: float) -> None:
        assert self._unique_id is not None, "join() before rendezvous_fields()"
        self._communicator = NcclCommunicator(
            self.library, self._unique_id, 0, world_size, self.device, timeout_s
        )
        self._communicator.all_reduce_sum(torch.zeros(1, device=self.device), timeout_s)

    def broadcast(self, buffer: torch.Tensor, timeout_s: float) -> None:
        assert self._communicator is not None, "broadcast() before join()"
        self._communicator.broadcast(buffer, root=0, timeout_s=timeout_s)

    def abort(self) -> None:
        if self._communicator is not None:
            self._communicator.abort()

    def close(self) -> None:
        if self._communicator is not None:
            self._communicator.close()
