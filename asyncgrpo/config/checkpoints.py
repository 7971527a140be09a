"""Config fields of the checkpoints: their layout, and whether they are written while training goes on."""

from __future__ import annotations

from dataclasses import dataclass, field

CHECKPOINT_FORMATS = ("auto", "sharded", "full")


@dataclass
class CheckpointFields:
    """How `save_steps` checkpoints are written (docs/scaling.md, "Checkpoints")."""

    checkpoint_format: str = field(
        default="auto",
        metadata={
            "help": "'sharded': every training process writes its own shards of the model and optimizer "
            "(torch.distributed.checkpoint); no process holds more than its shard, and the checkpoint "
            "resumes on any number of processes ('asyncgrpo export' makes a Hugging Face folder of it). "
            "'full': rank 0 gathers the whole model and optimizer and writes a Hugging Face folder plus "
            "optimizer.pt. 'auto': sharded with several processes (where gathering is what fails at "
            "scale), full with one (the checkpoint is then a folder from_pretrained loads)."
        },
    )
    checkpoint_async: bool = field(
        default=True,
        metadata={
            "help": "With sharded checkpoints, write them while training goes on: the shards are copied "
            "out of the live tensors beside the next step's forward and backward, whose optimizer update "
            "waits only for what is left of that copy. True: the point of sharding is that a save no "
            "longer holds training; on_save callbacks then run when the save starts, and the checkpoint "
            "directory appears once it is complete. False: the step waits for the whole save (for "
            "callbacks that read the checkpoint in on_save)."
        },
    )

    def _validate_checkpoints(self, fail) -> None:
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            fail(
                f"checkpoint_format={self.checkpoint_format!r} must be one of {', '.join(CHECKPOINT_FORMATS)}"
            )
