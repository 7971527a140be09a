"""Checkpoints that scale with the run (docs/reliability.md, "Durable checkpoints"; docs/scaling.md,
"Checkpoints"): every process writes its own shards of the model and optimizer
(torch.distributed.checkpoint), in the background, and a checkpoint resumes on any number of
processes; a checkpoint exports to a Hugging Face folder written shard by shard.

The modules take explicit inputs (a model, an optimizer, a directory, the processes' collectives),
never the trainer: `layout` (what a checkpoint directory holds), `sharded_state` (the state written
and read back, resharded), `background` (a save that overlaps training), `failures` (a failed save
reported and retried), `hf_folder` and `export` (the consolidated folder), `lora_merge`.
"""

import warnings

# One process writes and reads a sharded checkpoint without a process group on purpose (DCP's no_dist);
# torch warns about it at every call.
warnings.filterwarnings(
    "ignore",
    message=r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent",
    category=UserWarning,
)
