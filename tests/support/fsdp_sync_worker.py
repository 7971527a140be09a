"""One training process of `test_fsdp2_sharded_weights_sync_from_two_processes`: shard the tiny
model with FSDP2 over gloo (CPU), then take part in a weight sync (rank 0 sends to the double at
argv[1]); then shard a LoRA-wrapped tiny model and take part in adapter-only sync's gather (rank 0
writes the adapter under argv[2]). Run with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from weight_transfer_double import GlooTransport  # noqa: E402

from asyncgrpo.cli.tiny_model import TinyModelSpec, build_model, build_tokenizer  # noqa: E402
from asyncgrpo.generation.background import BackgroundLoop  # noqa: E402
from asyncgrpo.generation.client import VLLMClient  # noqa: E402
from asyncgrpo.weight_sync.lora import LoraAdapterSync  # noqa: E402
from asyncgrpo.weight_sync.nccl import NcclWeightSync  # noqa: E402


def lora_model() -> torch.nn.Module:
    """The tiny model with a LoRA adapter whose B is not zero (the test builds the same one)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(
        build_model(build_tokenizer(), TinyModelSpec()),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]),
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)
    return model


def sync_sharded_adapter(client, loop, directory: str) -> None:
    model = lora_model()
    for layer in model.get_base_model().model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert all(hasattr(p, "full_tensor") for n, p in model.named_parameters() if "lora_" in n), "not sharded"
    if dist.get_rank() == 0:
        LoraAdapterSync(client, loop, directory, keep=1).prepare(model, version=1)  # writes; no server call
    else:
        LoraAdapterSync(None, None, None, keep=1, is_sender=False).prepare(model, version=1)


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same weights as the test's unsharded reference
    model = build_model(build_tokenizer(), TinyModelSpec())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert any(hasattr(parameter, "full_tensor") for parameter in model.parameters()), "not sharded"
    client = loop = None
    if dist.get_rank() == 0:
        loop = BackgroundLoop()
        client = VLLMClient(sys.argv[1], timeout=60)
        backend = NcclWeightSync(client, loop, GlooTransport(), timeout_s=60, bucket_bytes=32 * 1024)
    else:
        backend = NcclWeightSync(None, None, None, timeout_s=60, is_sender=False)
    backend.sync(model, version=1)
    sync_sharded_adapter(client, loop, sys.argv[2])
    dist.barrier()
    if dist.get_rank() == 0:
        backend.close()
        loop.run(client.close())
        loop.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
