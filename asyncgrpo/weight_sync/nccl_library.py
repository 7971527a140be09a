"""A minimal ctypes binding to NCCL: just what the weight broadcast to vLLM needs.

Why not torch.distributed: vLLM's workers join the transfer group from a raw `ncclUniqueId`
(`nccl_unique_id_b64`), and torch's NCCL process group can neither mint nor accept one. Why not
vLLM's own wrapper: the trainer must not import vllm (it runs in its own environment).

Every wait here is bounded: collectives are enqueued on a CUDA stream and then polled with a
deadline; on timeout the communicator is aborted (which releases the kernels) and a clear error is
raised, so a peer that never arrives cannot hang the trainer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time
from pathlib import Path

import torch

from asyncgrpo.errors import WeightSyncError

NCCL_UNIQUE_ID_BYTES = 128
_IN_PROGRESS = 7  # ncclInProgress
_SUM = 0  # ncclSum
_DATA_TYPES = {  # ncclDataType_t
    torch.int8: 0,
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}


class NcclError(WeightSyncError):
    pass


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


def find_nccl_library() -> str:
    """The libnccl torch already loaded (same version as the trainer's collectives), else the
    `nvidia-nccl` wheel's, else the system's. `ASYNCGRPO_NCCL_LIBRARY` overrides."""
    override = os.environ.get("ASYNCGRPO_NCCL_LIBRARY")
    if override:
        return override
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1]
            if "libnccl.so" in os.path.basename(path):
                return path
    except OSError:
        pass
    try:
        import nvidia.nccl  # the wheel torch's CUDA builds depend on

        for folder in nvidia.nccl.__path__:
            candidate = Path(folder) / "lib" / "libnccl.so.2"
            if candidate.exists():
                return str(candidate)
    except ImportError:
        pass
    return ctypes.util.find_library("nccl") or "libnccl.so.2"


class NcclLibrary:
    def __init__(self, path: str | None = None):
        path = path or find_nccl_library()
        try:
            self._lib = ctypes.CDLL(path)
        except OSError as error:
            raise NcclError(
                f"cannot load the NCCL library ({path}): {error}; install torch with CUDA, or point "
                "ASYNCGRPO_NCCL_LIBRARY at libnccl.so.2"
            ) from None
        self.path = path
        lib = self._lib
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
        lib.ncclCommInitRank.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int,
            _UniqueId,
            ctypes.c_int,
        ]
        collective_tail = [ctypes.c_size_t, ctypes.c_int]
        lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *collective_tail, ctypes.c_int]
        lib.ncclAllReduce.argtypes += [ctypes.c_void_p, ctypes.c_void_p]
        lib.ncclBroadcast.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *collective_tail, ctypes.c_int]
        lib.ncclBroadcast.argtypes += [ctypes.c_void_p, ctypes.c_void_p]
        lib.ncclCommGetAsyncError.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        lib.ncclCommAbort.argtypes = [ctypes.c_void_p]
        lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]

    def check(self, result: int, what: str) -> None:
        if result not in (0, _IN_PROGRESS):
            message = self._lib.ncclGetErrorString(result).decode(errors="replace")
            raise NcclError(f"NCCL {what} failed: {message} (code {result})")

    def version(self) -> str:
        number = ctypes.c_int()
        self.check(self._lib.ncclGetVersion(ctypes.byref(number)), "ncclGetVersion")
        major, rest = divmod(number.value, 10000) if number.value >= 10000 else divmod(number.value, 1000)
        minor, patch = divmod(rest, 100)
        return f"{major}.{minor}.{patch}"

    def new_unique_id(self) -> bytes:
        unique_id = _UniqueId()
        self.check(self._lib.ncclGetUniqueId(ctypes.byref(unique_id)), "ncclGetUniqueId")
        return bytes(ctypes.string_at(ctypes.addressof(unique_id), NCCL_UNIQUE_ID_BYTES))


class NcclCommunicator:
    """One NCCL communicator on a CUDA device, joined from pre-shared unique id bytes. Work runs
    on that device's current stream, whichever thread calls."""

    def __init__(
        self,
        library: NcclLibrary,
        unique_id: bytes,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float,
    ):
        if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        self.library, self.rank, self.world_size = library, rank, world_size
        self.device = device
        self._comm: ctypes.c_void_p | None = None
        handle = _UniqueId()
        ctypes.memmove(ctypes.addressof(handle), unique_id, NCCL_UNIQUE_ID_BYTES)
        # ncclCommInitRank blocks until every rank has joined; it runs in a daemon thread so the
        # wait is bounded (a peer that never comes leaves that thread parked, not the trainer).
        outcome: dict[str, object] = {}

        def initialize() -> None:
            torch.cuda.set_device(self.device)
            comm = ctypes.c_void_p()
            try:
                library.check(
                    library._lib.ncclCommInitRank(ctypes.byref(comm), world_size, handle, rank),
                    "ncclCommInitRank",
                )
                outcome["comm"] = comm
            except NcclError as error:
                outcome["error"] = error

        joiner = threading.Thread(target=initialize, name="nccl-init", daemon=True)
        joiner.start()
        joiner.join(timeout_s)
        if "error" in outcome:
            raise outcome["error"]  # type: ignore[misc]
        if "comm" not in outcome:
            raise TimeoutError(
                f"NCCL rendezvous: not every one of the {world_size} ranks joined within {timeout_s:.0f} s "
                "(are the vLLM workers able to reach this host? check NCCL_SOCKET_IFNAME and the server log)"
            )
        self._comm = outcome["comm"]  # type: ignore[assignment]

    def all_reduce_sum(self, tensor: torch.Tensor, timeout_s: float) -> None:
        self._run("all_reduce", tensor, timeout_s, lambda lib, stream: lib.ncclAllReduce(
            tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), _data_type(tensor), _SUM, self._comm, stream
        ))  # fmt: skip

    def broadcast(self, tensor: torch.Tensor, root: int, timeout_s: float) -> None:
        """Broadcast `tensor` (contiguous, on this device) from `root`; returns once it completed."""
        self._run("broadcast", tensor, timeout_s, lambda lib, stream: lib.ncclBroadcast(
            tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), _data_type(tensor), root, self._comm, stream
        ))  # fmt: skip

    def _run(self, what: str, tensor: torch.Tensor, timeout_s: float, call) -> None:
        """Enqueue one collective on this device's current stream, then wait for it (bounded)."""
        if self._comm is None:
            raise NcclError("the NCCL communicator is closed")
        if not tensor.is_contiguous() or tensor.device != self.device:
            raise ValueError(f"{what} needs a contiguous tensor on {self.device}, got {tensor.device}")
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        self.library.check(call(self.library._lib, stream), what)
        self.wait(timeout_s, what)

    def wait(self, timeout_s: float, what: str) -> None:
        """Wait for the work enqueued so far on the current stream, polling NCCL for peer failures."""
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + timeout_s
        status = ctypes.c_int()
        while not done.query():
            self.library.check(
                self.library._lib.ncclCommGetAsyncError(self._comm, ctypes.byref(status)), what
            )
            self.library.check(status.value, f"{what} (asynchronous error)")
            if time.monotonic() > deadline:
                self.abort()
                raise TimeoutError(
                    f"NCCL {what} did not complete within {timeout_s:.0f} s: a peer stopped taking part "
                    "(the communicator was aborted; restart the vLLM server before syncing again)"
                )
            time.sleep(0.0005)

    def abort(self) -> None:
        if self._comm is not None:
            self.library._lib.ncclCommAbort(self._comm)
            self._comm = None

    def close(self) -> None:
        if self._comm is not None:
            self.library._lib.ncclCommDestroy(self._comm)
            self._comm = None


def _data_type(tensor: torch.Tensor) -> int:
    try:
        return _DATA_TYPES[tensor.dtype]
    except KeyError:
        raise ValueError(f"NCCL cannot carry {tensor.dtype}") from None
