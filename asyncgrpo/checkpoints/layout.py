"""What a checkpoint directory holds, and which of the two layouts a directory is in.

A sharded checkpoint (`checkpoint_format="sharded"`, written by every process):

  shards/                  torch.distributed.checkpoint: `.metadata` and one `__R_0.distcp` per rank,
                           keys `model.<name>` and `optim.state.<name>.<moment>`, `optim.param_groups`
  asyncgrpo_checkpoint.json  the manifest (`ShardedManifest`), written last by rank 0
  rng_state_R.pth          each rank's random generators
  scheduler.pt             the learning-rate schedule (rank 0: it is the same on every rank)
  config.json, generation_config.json, tokenizer files, adapter_config.json (a PEFT run)
  trainer_state.json, rollout_state.json, held_samples.npz/.json   as in the full layout

A full checkpoint (`checkpoint_format="full"`, and every checkpoint written before sharded ones
existed) is a Hugging Face model folder plus `optimizer.pt`, `scheduler.pt` and the same run files;
`from_pretrained` loads it as it is. docs/scaling.md, "Checkpoints", says who writes what.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from asyncgrpo.errors import ConfigurationError

SHARDS_DIR = "shards"
MANIFEST_FILE = "asyncgrpo_checkpoint.json"
SHARDED = "sharded"
FULL = "full"
MODEL_KEY = "model"
OPTIMIZER_KEY = "optim"
_FORMAT_NAME = "asyncgrpo-sharded"
_VERSION = 1


@dataclass
class ShardedManifest:
    """How a sharded checkpoint was written: enough to read it back on any number of processes and
    to export it without the trainer."""

    step: int
    world_size: int  # processes that wrote the shards (a resume may use another number)
    holds_optimizer: bool  # False with save_only_model: a resume starts a fresh optimizer
    dtype: str  # of the trained parameters, e.g. "float32": the exported weights keep it
    peft_adapter: str | None = None  # the adapter's name when only a PEFT adapter is trained
    # Names that share another parameter (tied embeddings): written once, under the name they alias.
    aliases: dict[str, str] = field(default_factory=dict)
    format: str = _FORMAT_NAME
    version: int = _VERSION

    def save(self, directory: Path) -> None:
        (Path(directory) / MANIFEST_FILE).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> ShardedManifest:
        path = Path(directory) / MANIFEST_FILE
        fields = json.loads(path.read_text())
        if fields.get("format") != _FORMAT_NAME or fields.get("version", 0) > _VERSION:
            raise ConfigurationError(
                f"{path}: a checkpoint of format {fields.get('format')!r} version {fields.get('version')}, "
                f"which this asyncgrpo cannot read (it reads {_FORMAT_NAME} up to version {_VERSION}): "
                "upgrade asyncgrpo"
            )
        return cls(**fields)


def checkpoint_layout(directory: str | Path) -> str:
    """SHARDED or FULL: the layout of the checkpoint in `directory`."""
    directory = Path(directory)
    if (directory / MANIFEST_FILE).is_file():
        return SHARDED
    if (directory / SHARDS_DIR).is_dir():
        raise ConfigurationError(
            f"{directory} holds shards but no {MANIFEST_FILE}: it is not a complete checkpoint (checkpoints "
            "are renamed into place only once complete: was it copied by hand before it was?)"
        )
    return FULL


def choose_layout(requested: str, world_size: int) -> str:
    """The layout a run writes: `checkpoint_format`, with "auto" sharded over several processes
    (gathering the whole state is what fails at scale) and full on one (a folder from_pretrained
    loads, and nothing to gather)."""
    if requested == "auto":
        return SHARDED if world_size > 1 else FULL
    return requested


def is_sharded(directory: str | Path) -> bool:
    return checkpoint_layout(directory) == SHARDED
