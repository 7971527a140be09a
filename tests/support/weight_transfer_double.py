"""A test double of the vLLM server's side of the native weight-transfer protocol.

Run as a process (`python weight_transfer_double.py --port P [--receiver gloo|nccl] [--fault F]`):
HTTP routes of a vLLM server in dev mode with `--weight-transfer-config '{"backend":"nccl"}'`, and
a receiver that joins the trainer's group at `rank_offset`, cuts the broadcast into buckets from
the update metadata and keeps what arrived. `GET /received` answers what the trainer's side is
checked against: per-tensor SHA-256 of the received bytes, the version, and the call log.

The receiver speaks gloo on CPU (so the protocol is tested on any machine, with `GlooTransport` as
the trainer's data plane) or NCCL on a GPU (the real data plane, with the trainer's `NcclTransport`).
Faults: `reject_update` (400 before receiving), `never_join` (init accepted, group never joined),
`stall_receive` (update accepted, broadcast never received), `die_on_update` (the process exits when
asked to receive: a receiver lost during a broadcast).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from asyncgrpo.weight_sync.buckets import plan_buckets, tensor_bytes  # noqa: E402

GROUP_TIMEOUT = timedelta(seconds=60)
_ABANDONED_GROUPS: list = []


def unpack(
    buffer: torch.Tensor, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]
) -> list[torch.Tensor]:
    """Inverse of `asyncgrpo.weight_sync.buckets.pack`, as vLLM's receiver does it: views of `buffer`
    with the given shapes and dtypes. The trainer only sends, so this lives with the server double."""
    sizes = [tensor_bytes(shape, dtype) for shape, dtype in zip(shapes, dtypes, strict=True)]
    if sum(sizes) != buffer.numel():
        raise ValueError(f"bucket holds {buffer.numel()} bytes, its metadata says {sum(sizes)}")
    tensors = []
    for piece, shape, dtype in zip(buffer.split(sizes), shapes, dtypes):
        if piece.storage_offset() % dtype.itemsize:
            piece = piece.clone()  # a view needs an offset aligned to the element size
        tensors.append(piece.view(dtype).view(tuple(shape)))
    return tensors


class GlooTransport:
    """The trainer's data plane over gloo on CPU: the same rank-0 role as `NcclTransport`."""

    device = torch.device("cpu")

    def __init__(self):
        self._store = None
        self._group = None

    def rendezvous_fields(self, server_host: str) -> dict:
        self._store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=GROUP_TIMEOUT
        )
        return {"master_address": "127.0.0.1", "master_port": self._store.port}

    def join(self, world_size: int, timeout_s: float) -> None:
        self._group = dist.ProcessGroupGloo(self._store, 0, world_size, timedelta(seconds=timeout_s))
        self._group.allreduce([torch.zeros(1)]).wait()

    def broadcast(self, buffer: torch.Tensor, timeout_s: float) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        work = self._group.broadcast([buffer], options)
        # Poll rather than `work.wait(timeout)`, which can hold the GIL for the whole wait and so
        # stall the thread that watches the server (NcclTransport's waits release it).
        deadline = time.monotonic() + timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"gloo broadcast did not complete within {timeout_s:.0f} s")
            time.sleep(0.001)
        work.wait()  # raises if it failed

    def abort(self) -> None:
        # Destroying a gloo group with a broadcast in flight blocks until that broadcast times out:
        # keep it referenced, as a stuck communicator is, and just stop using it.
        _ABANDONED_GROUPS.append(self._group)
        self._group = None

    def close(self) -> None:
        self._group, self._store = None, None


class Receiver:
    """The workers' side: join at `rank_offset`, warm up, receive buckets."""

    def __init__(self, kind: str, device: str):
        self.kind = kind
        self.device = torch.device(device)
        self.group = None
        self.bucket_bytes = 0

    def join(self, info: dict) -> None:
        self.bucket_bytes = int(info["packed_buffer_size_bytes"])
        assert info["packed"] is True, "the trainer sends packed buckets"
        rank, world_size = int(info["rank_offset"]), int(info["world_size"])
        if self.kind == "gloo":
            store = dist.TCPStore(
                info["master_address"], int(info["master_port"]), is_master=False, timeout=GROUP_TIMEOUT
            )
            self.group = dist.ProcessGroupGloo(store, rank, world_size, GROUP_TIMEOUT)
            self.group.allreduce([torch.zeros(1)]).wait()
            return
        from asyncgrpo.weight_sync.nccl_library import NcclCommunicator, NcclLibrary

        torch.cuda.set_device(self.device)
        unique_id = base64.b64decode(info["nccl_unique_id_b64"], validate=True)
        self.group = NcclCommunicator(NcclLibrary(), unique_id, rank, world_size, self.device, timeout_s=60)
        self.group.all_reduce_sum(torch.zeros(1, device=self.device), timeout_s=60)

    def receive(self, update_info: dict) -> dict[str, torch.Tensor]:
        names, shapes = update_info["names"], update_info["shapes"]
        dtypes = [getattr(torch, name) for name in update_info["dtype_names"]]
        sizes = [tensor_bytes(shape, dtype) for shape, dtype in zip(shapes, dtypes)]
        received = {}
        if self.kind == "nccl":
            torch.cuda.set_device(self.device)
        for bucket in plan_buckets(sizes, self.bucket_bytes):
            buffer = torch.empty(sum(sizes[i] for i in bucket), dtype=torch.uint8, device=self.device)
            if self.kind == "gloo":
                options = dist.BroadcastOptions()
                options.rootRank = 0
                self.group.broadcast([buffer], options).wait()
            else:
                self.group.broadcast(buffer, root=0, timeout_s=60)
            parts = unpack(buffer, [shapes[i] for i in bucket], [dtypes[i] for i in bucket])
            for index, tensor in zip(bucket, parts):
                received[names[index]] = tensor.clone()  # checksummed on request, off the timed path
        return received


def checksum(tensor: torch.Tensor) -> str:
    raw = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def make_app(receiver: Receiver, fault: str) -> web.Application:
    state = {"log": [], "version": None, "weights": {}, "paused": False}

    async def logged(request: web.Request) -> dict:
        state["log"].append(request.path)
        return await request.json() if request.can_read_body else {}

    async def world_size(request):
        return web.json_response({"world_size": 1})

    async def pause(request):
        await logged(request)
        state["paused"] = True
        return web.json_response({})

    async def resume(request):
        await logged(request)
        state["paused"] = False
        return web.json_response({})

    async def init(request):
        body = await logged(request)
        if fault == "never_join":
            await asyncio.sleep(3600)
        await asyncio.to_thread(receiver.join, body["init_info"])
        return web.json_response({"message": "Weight transfer initialized"})

    async def start(request):
        await logged(request)
        if not state["paused"]:
            return web.json_response({"error": "start_weight_update while generating"}, status=409)
        return web.json_response({})

    async def update(request):
        body = await logged(request)
        if fault == "reject_update":
            return web.json_response({"error": "update_info: unknown parameter 'bogus'"}, status=400)
        if fault == "stall_receive":
            await asyncio.sleep(3600)
        if fault == "die_on_update":
            os._exit(1)
        state["weights"] = await asyncio.to_thread(receiver.receive, body["update_info"])
        return web.json_response({"message": "Weights updated"})

    async def finish(request):
        body = await logged(request)
        state["version"] = body.get("weight_version")
        return web.json_response({})

    async def shutdown(request):
        await logged(request)
        return web.json_response({})

    async def weight_info(request):
        return web.json_response({"weight_version": state["version"] or "default"})

    async def health(request):
        return web.Response()

    async def received(request):
        checksums = {name: checksum(tensor) for name, tensor in state["weights"].items()}
        return web.json_response({"version": state["version"], "checksums": checksums, "log": state["log"]})

    app = web.Application(client_max_size=1 << 30)
    app.router.add_get("/get_world_size", world_size)
    app.router.add_post("/pause", pause)
    app.router.add_post("/resume", resume)
    app.router.add_post("/init_weight_transfer_engine", init)
    app.router.add_post("/start_weight_update", start)
    app.router.add_post("/update_weights", update)
    app.router.add_post("/finish_weight_update", finish)
    app.router.add_post("/shutdown_weight_transfer_engine", shutdown)
    app.router.add_get("/weight_info", weight_info)
    app.router.add_get("/health", health)
    app.router.add_get("/received", received)
    return app


def start_double(
    fault: str = "none", receiver: str = "gloo", device: str = "cpu", port: int | None = None
) -> tuple[subprocess.Popen, str]:
    """Start the double in its own process (on `port`, default a free one): (the process, its URL)."""
    if port is None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    command = [sys.executable, __file__, "--port", str(port), "--fault", fault, "--receiver", receiver]
    process = subprocess.Popen(command + ["--device", device], stdout=subprocess.PIPE, text=True)
    if process.stdout.readline().strip() != "READY":
        process.kill()
        raise AssertionError("the double did not start")
    return process, f"http://127.0.0.1:{port}"


@contextmanager
def running_double(fault: str = "none", receiver: str = "gloo", device: str = "cpu"):
    """Start the double in its own process; yields its base URL."""
    process, url = start_double(fault, receiver, device)
    try:
        yield url
    finally:
        process.kill()
        process.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--receiver", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--fault",
        choices=["none", "reject_update", "never_join", "stall_receive", "die_on_update"],
        default="none",
    )
    args = parser.parse_args()
    web.run_app(
        make_app(Receiver(args.receiver, args.device), args.fault),
        host="127.0.0.1",
        port=args.port,
        print=lambda _: print("READY", flush=True),
    )


if __name__ == "__main__":
    main()
