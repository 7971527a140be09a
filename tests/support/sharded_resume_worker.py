"""One process of the resharding tests (tests/integration/test_sharded_checkpoints.py): the tiny model trained
with AdamW on a fixed batch, on one process or, under torchrun, FSDP2-sharded over several (gloo), as the
trainer shards it. No server: the step is the model's causal-LM loss on the same batch on every rank,
so one process and several compute the same steps.

argv: mode, model dir, checkpoint dir, output JSON.
- `train`: four steps; after step 2 a sharded checkpoint is copied and written in the background while
  steps 3 and 4 train (asyncgrpo/checkpoints/background.py; step 3's update waits for the copy), then
  published by rank 0.
- `resume`: the checkpoint read into this run's model and optimizer, whatever the number of processes
  that wrote it, then steps 3 and 4.
Rank 0 writes {"losses": {step: loss}, "world_size": N} to the output JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from asyncgrpo.checkpoints.background import ShardedWriter  # noqa: E402
from asyncgrpo.checkpoints.layout import SHARDS_DIR, ShardedManifest  # noqa: E402
from asyncgrpo.checkpoints.sharded_state import load_training_state, tied_aliases, training_state  # noqa: E402
from asyncgrpo.run.durable_files import staging_path  # noqa: E402
from asyncgrpo.trainer.checkpoint_saves import publish_sharded  # noqa: E402
from asyncgrpo.trainer.distributed import Processes, shard_model  # noqa: E402

SAVED_STEP = 2


def main() -> None:
    mode, model_dir, checkpoint, output = sys.argv[1:5]
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    processes = (
        Processes(dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else Processes(1, 0)
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if processes.distributed:
        shard_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    batch = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))

    writer = ShardedWriter(processes, asynchronous=True)

    def step() -> float:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        writer.wait_for_copy()  # a save in flight has its copy of the weights before they change
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    losses = {}
    if mode == "train":
        for number in range(1, 5):
            losses[number] = step()
            if number == SAVED_STEP:
                save(writer, model, model_dir, optimizer, Path(checkpoint), processes)
        result = writer.settle(wait=True)
        assert result is not None and result.error is None, result
    else:
        manifest = ShardedManifest.load(checkpoint)
        assert load_training_state(model, optimizer, checkpoint, manifest, processes.distributed)
        for number in range(SAVED_STEP + 1, 5):
            losses[number] = step()
    writer.close()
    if processes.is_main:
        Path(output).write_text(json.dumps({"losses": losses, "world_size": processes.world_size}))
    if dist.is_initialized():
        dist.destroy_process_group()


def save(
    writer: ShardedWriter, model, model_dir: str, optimizer, destination: Path, processes: Processes
) -> None:
    """Started at step 2 on every rank; the steps after it train while it is written."""
    staging = staging_path(destination)
    if processes.is_main:
        staging.mkdir(parents=True)
        for path in Path(model_dir).iterdir():  # the config and the tokenizer, as rank 0 writes them
            if path.suffix != ".safetensors":
                shutil.copyfile(path, staging / path.name)
    processes.gather(None)
    manifest = ShardedManifest(
        step=SAVED_STEP, world_size=processes.world_size, holds_optimizer=True, dtype="float32",
        aliases=tied_aliases(model),
    )  # fmt: skip
    publish = None
    if processes.is_main:

        def publish() -> None:
            publish_sharded(staging, destination, manifest, None, None, None, None)

    writer.start(
        SAVED_STEP, training_state(model, optimizer, trainable_only=False), staging / SHARDS_DIR, publish
    )


if __name__ == "__main__":
    main()
