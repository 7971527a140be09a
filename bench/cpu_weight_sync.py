"""The weight sync to a vLLM CPU server: safetensors under output_dir (`filesystem`) against the same
through RAM (`shared_memory`, /dev/shm), per sync: writing the version while the server generates,
the pause, the reload, and the bytes the write sent towards the disk.

The model has Qwen3-0.6B's layer shape (hidden 1024, MLP 3072, 16 heads of 128, 8 KV heads) with
`--layers` of them and the tiny tokenizer's vocabulary, served in float32 as the trainer holds it. One
server; the two backends alternate sync by sync so that both see the same load, and the weights change
before every sync (as training changes them). A sync runs as `WeightSyncBackend.sync` runs it:
prepare, pause, apply, resume.

Run: `.venv/bin/python bench/cpu_weight_sync.py [--layers 14] [--syncs 6] [--out DIR]`. Last lines:
`cpu_weight_sync backend=B bytes=N sync_s=S prepare_s=X paused_s=Y reload_s=Z disk_write_bytes=W`
(medians; sync_s is what the training loop waits for, paused_s what generation waits for).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncgrpo.cli.tiny_model import TinyModelSpec, save_tiny_model  # noqa: E402
from asyncgrpo.generation.background import BackgroundLoop  # noqa: E402
from asyncgrpo.generation.client import VLLMClient  # noqa: E402
from asyncgrpo.generation.server import ServerOptions, VLLMServer  # noqa: E402
from asyncgrpo.weight_sync import make_weight_sync  # noqa: E402
from asyncgrpo.weight_sync.base import serving_tensors  # noqa: E402
from asyncgrpo.weight_sync.buckets import tensor_bytes  # noqa: E402

BACKENDS = ("filesystem", "shared_memory")


def qwen3_0_6b_layers(layers: int) -> TinyModelSpec:
    return TinyModelSpec(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128,
    )  # fmt: skip


def disk_write_bytes() -> int:
    """Bytes this process has caused to be sent to the storage layer (/proc/self/io): a tmpfs
    write sends none."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def timed_sync(backend, client, loop, model, version: int) -> dict:
    """One sync in the order `WeightSyncBackend.sync` takes, each part timed."""
    written = disk_write_bytes()
    started = time.perf_counter()
    prepared = backend.prepare(model, version)
    staged = time.perf_counter()
    written = disk_write_bytes() - written
    loop.run(client.pause(mode="keep", clear_cache=False))
    paused = time.perf_counter()
    backend.apply(prepared, version, client.base_urls)
    reloaded = time.perf_counter()
    loop.run(client.resume())
    resumed = time.perf_counter()
    return {
        "sync_s": resumed - started,  # what the training loop waits for
        "prepare_s": staged - started,
        "paused_s": resumed - staged,
        "reload_s": reloaded - paused,
        "disk_write_bytes": written,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--syncs", type=int, default=6, help="syncs per backend")
    parser.add_argument("--out", default=None, help="output_dir of the filesystem sync, and the server log")
    options = parser.parse_args()
    torch.set_num_threads(1)  # as the trainer beside a CPU server
    out = Path(options.out or tempfile.mkdtemp(prefix="asyncgrpo-cpu-sync-")).resolve()
    model_dir = save_tiny_model(out / "model", spec=qwen3_0_6b_layers(options.layers))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    served_bytes = sum(tensor_bytes(t.shape, t.dtype) for _, t in serving_tensors(model))
    print(f"[cpu_weight_sync] {served_bytes / 2**30:.2f} GiB of weights, {options.layers} layers", flush=True)
    server = VLLMServer(
        ServerOptions(model=str(model_dir), port=free_port(), max_model_len=512, dtype="float32", cpu=True),
        log_path=out / "vllm.log",
    )
    server.start()
    loop = BackgroundLoop(default_timeout_s=600)
    client = VLLMClient(server.options.url, timeout=600)
    backends = {name: make_weight_sync(name, client, loop, out, timeout_s=600) for name in BACKENDS}
    results: dict[str, list[dict]] = {name: [] for name in BACKENDS}
    try:
        version = 0
        for round_ in range(options.syncs):
            for name in BACKENDS if round_ % 2 == 0 else reversed(BACKENDS):
                version += 1
                with torch.no_grad():  # training changed the weights since the last sync
                    for parameter in model.parameters():
                        parameter.mul_(1.0 + 1e-3)
                timings = timed_sync(backends[name], client, loop, model, version)
                results[name].append(timings)
                print(f"[cpu_weight_sync] v{version} {name}: " + ", ".join(
                    f"{key} {value:.3f}" if key.endswith("_s") else f"{key} {value}"
                    for key, value in timings.items()
                ) + f" (load average {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    finally:
        for backend in backends.values():
            backend.close()
        loop.run(client.close())
        loop.close()
        server.stop()
    for name in BACKENDS:
        median = {key: statistics.median(r[key] for r in results[name]) for key in results[name][0]}
        print(
            f"cpu_weight_sync backend={name} bytes={served_bytes} sync_s={median['sync_s']:.3f} "
            f"prepare_s={median['prepare_s']:.3f} "
            f"paused_s={median['paused_s']:.3f} reload_s={median['reload_s']:.3f} "
            f"disk_write_bytes={median['disk_write_bytes']:.0f}"
        )


if __name__ == "__main__":
    main()
