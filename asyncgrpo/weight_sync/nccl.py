"""NCCL weight sync over vLLM's native weight-transfer protocol (`--weight-transfer-config
'{"backend":"nccl"}'`), with the trainer as rank 0 of a group that holds every server's workers.

Every server of the sync joins the group at its `rank_offset` while the trainer joins as rank 0: at
start, and again whenever the set of servers changes (a server lost, back, or new), since a group
that holds a dead receiver would stall every broadcast: it is torn down and formed anew without it.
Per sync, while the servers are paused, rank 0 broadcasts the weights in buckets as the servers
receive them. Every HTTP call and every collective has a deadline, and on any failure the group is
aborted. A failure that a lost server explains leaves the others paused (they may hold part of the
weights) and out of the run until a full sync with a new group gives them the weights again; any
other failure stops the run. The protocol, step by step: docs/architecture.md#weight-sync.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlparse

import torch

from asyncgrpo.errors import WeightSyncError
from asyncgrpo.generation.client import VLLMRequestError, VLLMUnavailableError, policy_label
from asyncgrpo.modeling.sharded import full_tensor
from asyncgrpo.weight_sync.base import WeightSyncBackend, join_gathers, serving_tensors
from asyncgrpo.weight_sync.buckets import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_NUM_BUFFERS,
    pack,
    plan_buckets,
    tensor_bytes,
)
from asyncgrpo.weight_sync.transport import BroadcastTransport

logger = logging.getLogger(__name__)

# After a failure the servers may be stuck inside a collective: cleanup calls wait this long at most.
CLEANUP_TIMEOUT_S = 10.0


class WeightTransferError(WeightSyncError):
    pass


@dataclass
class PreparedWeights:
    tensors: list[tuple[str, torch.Tensor]]  # possibly sharded; gathered bucket by bucket
    update_info: dict  # names, dtype_names, shapes: what the servers will receive, in order


class NcclWeightSync(WeightSyncBackend):
    name = "nccl"

    def __init__(
        self,
        client,
        loop,
        transport: BroadcastTransport | None,
        timeout_s: float,
        is_sender: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ):
        super().__init__(client, loop, is_sender)
        if is_sender and transport is None:
            raise ValueError("the sending process needs a broadcast transport")
        self.transport = transport
        self.timeout_s = float(timeout_s)
        self.bucket_bytes = int(bucket_bytes)
        self._broken: str | None = None
        self.members: list[str] = []  # the servers whose workers are in the group
        self._regroup_due = False  # a member restarted: the group must be formed again
        if is_sender:
            self._connect(list(self.client.base_urls))

    def _connect(self, urls: list[str]) -> None:
        world_sizes = self.loop.run(self.client.world_sizes(urls), timeout=self.timeout_s)
        world_size = 1 + sum(world_sizes)
        fields = self.transport.rendezvous_fields(urlparse(urls[0]).hostname or "127.0.0.1")
        init_infos, offset = {}, 1
        for url, workers in zip(urls, world_sizes, strict=True):
            init_infos[url] = {
                **fields,
                "rank_offset": offset,
                "world_size": world_size,
                "packed": True,
                "packed_buffer_size_bytes": self.bucket_bytes,
                "packed_num_buffers": DEFAULT_NUM_BUFFERS,
            }
            offset += workers
        logger.info(
            "joining %d vLLM worker(s) of %d server(s) for NCCL weight transfer", world_size - 1, len(urls)
        )
        joined = self.loop.submit(self.client.init_weight_transfer_engine(init_infos))
        try:
            _run_alongside(
                joined, lambda: self.transport.join(world_size, self.timeout_s), self.timeout_s, "joining"
            )
        except BaseException:
            self.transport.abort()
            raise
        self.members, self._regroup_due = list(urls), False

    def _regroup(self, urls: list[str]) -> None:
        """Tear the group down (on the members still in the sync: the others are lost) and form it
        anew with `urls`."""
        if self.members:
            survivors = [url for url in self.members if url in urls]
            if survivors:
                self._best_effort(
                    self.client.shutdown_weight_transfer_engine(survivors, timeout=CLEANUP_TIMEOUT_S)
                )
            self.transport.abort()  # not close(): a dead peer must not be waited for
            self.members = []
        if urls:
            self._connect(urls)

    def prepare(self, model: torch.nn.Module, version: int) -> PreparedWeights | None:
        if not self.is_sender:
            join_gathers(model)
            return None
        tensors = serving_tensors(model)
        update_info = {
            "names": [name for name, _ in tensors],
            "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in tensors],
            "shapes": [list(tensor.shape) for _, tensor in tensors],
        }
        return PreparedWeights(tensors, update_info)

    def apply(self, prepared: PreparedWeights, version: int, urls: list[str]) -> list[str]:
        if self._broken:
            raise WeightTransferError(
                f"NCCL weight transfer is unusable after an earlier failure: {self._broken}"
            )
        if not urls:  # no server to send to: the gathers still run, in step with the other processes
            for _name, tensor in prepared.tensors:
                full_tensor(tensor)
            return []
        try:
            if self._regroup_due or self.members != urls:
                self._regroup(urls)
            self.loop.run(
                self.client.start_weight_update(urls, timeout=self.timeout_s), timeout=self.timeout_s
            )
            received = self.loop.submit(
                self.client.update_weights(prepared.update_info, urls, timeout=self.timeout_s)
            )
            _run_alongside(
                received, lambda: self._broadcast(prepared.tensors), self.timeout_s, "sending weights"
            )
            self.loop.run(
                self.client.finish_weight_update(policy_label(version), urls, timeout=self.timeout_s),
                timeout=self.timeout_s,
            )
        except BaseException as error:
            failure = f"{type(error).__name__}: {error}"
            self.transport.abort()
            self.members = []  # the next sync forms a new group
            self._best_effort(
                self.client.finish_weight_update(policy_label(version), urls, timeout=CLEANUP_TIMEOUT_S)
            )
            if not isinstance(error, Exception):
                raise  # an interrupt stays an interrupt (after the cleanup above)
            lost = self._unreachable(urls)
            if not lost:
                self._broken = failure
                raise WeightTransferError(
                    f"weight sync v{version} failed ({failure}); the vLLM server may be stuck in the "
                    "transfer: restart it before training on"
                ) from error
            logger.warning(
                "weight sync v%d failed (%s): vLLM server(s) %s were lost during it; the others may hold "
                "part of the weights and stay paused until a new group gives them the whole",
                version,
                failure,
                ", ".join(lost),
            )
            return list(urls)
        return []

    def _unreachable(self, urls: list[str]) -> list[str]:
        """The servers among `urls` that do not answer now (an error answer is an answer)."""

        async def answers(url: str) -> bool:
            try:
                await self.client.probe(url, CLEANUP_TIMEOUT_S)
            except VLLMUnavailableError:
                return False
            except VLLMRequestError:
                pass
            return True

        async def all_answers() -> list[bool]:
            return list(await asyncio.gather(*(answers(url) for url in urls)))

        return [url for url, answered in zip(urls, self.loop.run(all_answers())) if not answered]

    def reconnect(self) -> None:
        """A server restarted and left the transfer group: the next sync forms a new one (torn down
        first on the servers that kept it)."""
        self._regroup_due = True

    def _broadcast(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Gather (a collective under FSDP2, on the default stream, before the tensor reaches the
        broadcast: gathers and broadcasts never interleave across streams, so they cannot
        deadlock) and send, one bucket at a time."""
        if self.transport.device.type == "cuda":
            torch.cuda.set_device(self.transport.device)  # this runs in a helper thread
        sizes = [tensor_bytes(tensor.shape, tensor.dtype) for _, tensor in tensors]
        for bucket in plan_buckets(sizes, self.bucket_bytes):
            parts = [full_tensor(tensors[index][1]).to(self.transport.device) for index in bucket]
            self.transport.broadcast(pack(parts), self.timeout_s)

    def _best_effort(self, coroutine) -> None:
        try:
            self.loop.run(coroutine, timeout=CLEANUP_TIMEOUT_S + 1)
        except Exception as error:  # already failing: the first error is the one that matters
            logger.warning("weight transfer cleanup: %s", error)

    def close(self) -> None:
        if not self.is_sender:
            return
        if not self._broken and self.members:
            self._best_effort(
                self.client.shutdown_weight_transfer_engine(self.members, timeout=CLEANUP_TIMEOUT_S)
            )
        self.transport.close()


def vllm_at_least(version: str, minimum: tuple[int, int]) -> bool:
    """Whether a vLLM version string ("0.32.0+cpu", "0.11.1rc2.dev3") is at least major.minor."""
    parts = re.findall(r"\d+", version)[:2]
    return len(parts) == 2 and (int(parts[0]), int(parts[1])) >= minimum


def _run_alongside(
    remote: concurrent.futures.Future, local: Callable[[], None], timeout_s: float, what: str
) -> None:
    """Run `local` (rank 0's side of a collective) while `remote` (the servers' side, an HTTP call)
    runs; return when both finished. Whichever fails first is raised at once: a server that
    rejects the call must not leave the trainer waiting out the collective's timeout."""
    outcome: dict[str, BaseException | None] = {}

    def run_local() -> None:
        try:
            local()
            outcome["local"] = None
        except BaseException as error:  # handed to the waiting thread
            outcome["local"] = error

    worker = threading.Thread(target=run_local, name=f"weight-transfer {what}", daemon=True)
    worker.start()
    deadline = time.monotonic() + timeout_s
    while True:
        if "local" in outcome and outcome["local"] is not None:
            raise outcome["local"]
        if remote.done() and remote.exception() is not None:
            raise WeightTransferError(f"the vLLM server failed while {what}: {remote.exception()}")
        if "local" in outcome and remote.done():
            return
        if time.monotonic() > deadline:
            side = "the trainer's broadcast" if "local" not in outcome else "the vLLM server"
            raise TimeoutError(
                f"{what}: {side} did not finish within {timeout_s:.0f} s (weight_sync_timeout)"
            )
        time.sleep(0.002)
