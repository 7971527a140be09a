"""NCCL weight sync of a Qwen3-1.7B-shaped model (bf16): time per sync vs bytes, against the
GPU-to-GPU bandwidth measured in the same call, and bit-exactness at the receiver.

The receiver is the test double of vLLM's side (tests/support/weight_transfer_double.py) in its own
process on GPU 0; the trainer sends from GPU 1 through the production backend (NcclWeightSync +
NcclTransport, ctypes NCCL). Target: effective sync bandwidth >= 70% of the measured GPU-to-GPU
copy bandwidth.

With one GPU the transfer cannot be measured (NCCL refuses two ranks on one device); the script
then measures what the sender does alone (gathering and packing the buckets) and the ctypes NCCL
path on a one-rank group, and says the target was not measured.

Run (GPU machine): `python bench/weight_sync.py`. Last line:
`weight_sync bytes=B sync_s=S effective_GBps=E p2p_GBps=P ratio=R target=0.70` (or `... not measured`).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from weight_transfer_double import running_double  # noqa: E402

from asyncgrpo.generation.background import BackgroundLoop  # noqa: E402
from asyncgrpo.generation.client import VLLMClient  # noqa: E402
from asyncgrpo.weight_sync.base import serving_tensors  # noqa: E402
from asyncgrpo.weight_sync.buckets import DEFAULT_BUCKET_BYTES, pack, plan_buckets, tensor_bytes  # noqa: E402
from asyncgrpo.weight_sync.nccl import NcclWeightSync  # noqa: E402
from asyncgrpo.weight_sync.nccl_library import NcclCommunicator, NcclLibrary  # noqa: E402
from asyncgrpo.weight_sync.transport import NcclTransport  # noqa: E402

QWEN3_1_7B = dict(
    hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128, vocab_size=151936, tie_word_embeddings=True,
)  # fmt: skip


def log(message: str) -> None:
    print(message, flush=True)


def build(device: torch.device, layers: int) -> torch.nn.Module:
    with torch.device(device):
        config = Qwen3Config(**{**QWEN3_1_7B, "num_hidden_layers": layers})
        return Qwen3ForCausalLM(config).to(torch.bfloat16)


def gpu_checksums(model) -> dict[str, str]:
    return {
        name: hashlib.sha256(
            t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
        ).hexdigest()
        for name, t in serving_tensors(model)
    }


def timed(function, device: torch.device) -> float:
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    function()
    torch.cuda.synchronize(device)
    return time.perf_counter() - started


def copy_bandwidth(source: torch.device, target: torch.device, gigabytes: float = 1.0) -> float:
    payload = torch.empty(int(gigabytes * 2**30), dtype=torch.uint8, device=source)
    landing = torch.empty_like(payload, device=target)
    landing.copy_(payload)  # warm-up (peer mapping)
    seconds = min(timed(lambda: landing.copy_(payload), source) for _ in range(5))
    return payload.numel() / seconds / 1e9


def sender_alone(model, device: torch.device, bucket_bytes: int) -> None:
    tensors = serving_tensors(model)
    sizes = [tensor_bytes(t.shape, t.dtype) for _, t in tensors]
    total = sum(sizes)

    def pack_all():
        for bucket in plan_buckets(sizes, bucket_bytes):
            pack([tensors[i][1] for i in bucket])

    seconds = min(timed(pack_all, device) for _ in range(3))
    log(
        f"sender alone: {len(tensors)} tensors, {total / 1e9:.2f} GB, "
        f"{len(plan_buckets(sizes, bucket_bytes))} buckets; gather+pack {seconds * 1e3:.0f} ms "
        f"({total / seconds / 1e9:.0f} GB/s)"
    )
    library = NcclLibrary()
    log(f"NCCL {library.version()} from {library.path}")
    communicator = NcclCommunicator(library, library.new_unique_id(), 0, 1, device, timeout_s=60)
    communicator.all_reduce_sum(torch.zeros(1, device=device), timeout_s=60)
    buffer = pack([tensors[i][1] for i in plan_buckets(sizes, bucket_bytes)[0]])
    seconds = min(
        timed(lambda: communicator.broadcast(buffer, root=0, timeout_s=60), device) for _ in range(3)
    )
    log(
        f"one-rank NCCL broadcast of a {buffer.numel() / 1e9:.2f} GB bucket: {seconds * 1e3:.1f} ms (no peer)"
    )
    communicator.close()


def full_transfer(model, bucket_bytes: int, repeats: int) -> tuple[int, float]:
    receiver, sender = torch.device("cuda", 0), torch.device("cuda", 1)
    expected = gpu_checksums(model)
    total = sum(tensor_bytes(t.shape, t.dtype) for _, t in serving_tensors(model))
    loop = BackgroundLoop()
    with running_double(receiver="nccl", device=str(receiver)) as url:
        client = VLLMClient(url, timeout=300)
        started = time.perf_counter()
        backend = NcclWeightSync(client, loop, NcclTransport(), timeout_s=300, bucket_bytes=bucket_bytes)
        log(f"joined the receiver in {time.perf_counter() - started:.1f} s")
        times = []
        for version in range(1, repeats + 1):
            prepared = backend.prepare(model, version)
            started = time.perf_counter()
            backend.apply(prepared, version, client.base_urls)
            times.append(time.perf_counter() - started)
            log(f"sync v{version}: {times[-1] * 1e3:.0f} ms for {total / 1e9:.2f} GB")
        import requests

        answer = requests.get(url + "/received", timeout=600).json()
        exact = answer["checksums"] == expected
        log(
            f"bit-exact at the receiver: {exact} ({len(answer['checksums'])} tensors, version "
            f"{answer['version']})"
        )
        if not exact:
            raise SystemExit("weights arrived corrupted")
        backend.close()
        loop.run(client.close())
    loop.close()
    del sender
    return total, min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=28, help="fewer for a quick check")
    parser.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    log(f"{gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    if gpus < 2:
        device = torch.device("cuda", 0)
        sender_alone(build(device, args.layers), device, args.bucket_bytes)
        log(
            "weight_sync transfer not measured: needs two GPUs (receiver on GPU 0, trainer on GPU 1) "
            "target=0.70"
        )
        return
    p2p = copy_bandwidth(torch.device("cuda", 1), torch.device("cuda", 0))
    log(f"GPU 1 -> GPU 0 copy: {p2p:.0f} GB/s")
    torch.cuda.set_device(1)
    model = build(torch.device("cuda", 1), args.layers)
    sender_alone(model, torch.device("cuda", 1), args.bucket_bytes)
    total, seconds = full_transfer(model, args.bucket_bytes, args.repeats)
    effective = total / seconds / 1e9
    log(
        f"weight_sync bytes={total} sync_s={seconds:.3f} effective_GBps={effective:.0f} p2p_GBps={p2p:.0f} "
        f"ratio={effective / p2p:.2f} target=0.70"
    )


if __name__ == "__main__":
    main()
