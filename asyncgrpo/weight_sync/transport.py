"""The data plane of the NCCL weight sync: how the trainer (rank 0) meets the vLLM workers and
broadcasts bytes to them. The protocol around it (HTTP calls, order, buckets) is in `nccl.py`.

Two rendezvous, both ending in one NCCL communicator with the trainer as rank 0:
- `unique_id` (vLLM >= 0.30): the trainer mints an `ncclUniqueId` and sends it, base64, in the
  init payload. No extra port, no store.
- `tcp_store` (older servers): the trainer hosts the TCP store vLLM's `StatelessProcessGroup`
  joins and publishes the id there, in the form that group's `broadcast_obj` reads.
Either way the workers issue a one-element float32 all-reduce right after joining, so the trainer
must issue the matching one before anything else.
"""

from __future__ import annotations

import base64
import socket
from datetime import timedelta
from typing import Protocol

import torch

from asyncgrpo.weight_sync.nccl_library import NcclCommunicator, NcclLibrary

RENDEZVOUS_MODES = ("unique_id", "tcp_store")


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
    def __init__(self, rendezvous: str = "unique_id", library: NcclLibrary | None = None):
        if rendezvous not in RENDEZVOUS_MODES:
            raise ValueError(f"rendezvous={rendezvous!r} must be one of {RENDEZVOUS_MODES}")
        if not torch.cuda.is_available():
            raise RuntimeError(
                "NCCL weight sync needs a CUDA GPU on the trainer; use weight_sync_backend='filesystem'"
            )
        self.rendezvous = rendezvous
        self.library = library or NcclLibrary()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._unique_id: bytes | None = None
        self._store: torch.distributed.TCPStore | None = None
        self._communicator: NcclCommunicator | None = None

    def rendezvous_fields(self, server_host: str) -> dict:
        self._unique_id = self.library.new_unique_id()
        if self.rendezvous == "unique_id":
            return {"nccl_unique_id_b64": base64.b64encode(self._unique_id).decode()}
        address = local_address_towards(server_host)
        self._store = torch.distributed.TCPStore(
            address, 0, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=5)
        )
        # StatelessProcessGroup.broadcast_obj: rank r reads key "broadcast_from/0/<n>" for the n-th
        # object rank 0 broadcast; the NCCL id is the first one.
        self._store.set("broadcast_from/0/0", pickled_vllm_unique_id(self._unique_id))
        return {"master_address": address, "master_port": self._store.port}

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
        self._store = None


def local_address_towards(host: str) -> str:
    """This machine's address on the route to `host` (what a server there can connect back to)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))  # UDP: no packet is sent
        return probe.getsockname()[0]


def pickled_vllm_unique_id(unique_id: bytes) -> bytes:
    """The pickle of vLLM's `ncclUniqueId` ctypes structure holding `unique_id`, written opcode by
    opcode so the trainer need not import vllm: `_ctypes._unpickle(ncclUniqueId, ({}, bytes))`."""
    if len(unique_id) != 128:
        raise ValueError(f"an NCCL unique id has 128 bytes, got {len(unique_id)}")
    return (
        b"\x80\x04"  # PROTO 4
        b"c_ctypes\n_unpickle\n"  # GLOBAL
        b"cvllm.distributed.device_communicators.pynccl_wrapper\nncclUniqueId\n"  # GLOBAL
        b"}"  # EMPTY_DICT
        b"C\x80"
        + unique_id  # SHORT_BINBYTES (128)
        + b"\x86"  # TUPLE2: ({}, bytes)
        b"\x86"  # TUPLE2: (class, state)
        b"R."  # REDUCE, STOP
    )
