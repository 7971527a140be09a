"""`accelerate launch --config_file fsdp2.yaml`, TRL's documented multi-GPU launch.

This trainer applies FSDP2 itself (trainer/distributed.py: each decoder layer its own unit, the
packed forward registered with the root), so accelerate must not wrap the model: a model wrapped
by accelerate would run its root's parameters sharded through a forward FSDP does not know. An
accelerate FSDP config is read here instead: the settings with a counterpart are applied, the rest
are said in one message, and only what cannot work here is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from asyncgrpo.errors import ConfigurationError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FsdpLaunch:
    reshard_after_forward: bool = True  # passed to fully_shard
    notes: list[str] = field(default_factory=list)  # what of the config is not applied, and why


def read_fsdp_launch(plugin) -> FsdpLaunch | None:
    """The settings of accelerate's FSDP plugin (None: not an FSDP launch) this trainer applies."""
    if plugin is None:
        return None
    offload = getattr(plugin, "cpu_offload", None)
    if type(offload).__name__ == "CPUOffloadPolicy" or getattr(offload, "offload_params", False):
        raise ConfigurationError(
            "the accelerate FSDP config sets fsdp_offload_params: true, which asyncgrpo does not support "
            "(the weight sync and the packed forward need the parameters on the training device); set it to "
            "false"
        )
    notes = []
    version = getattr(plugin, "fsdp_version", 1) or 1
    if version != 2:
        notes.append(
            f"fsdp_version={version} is applied as FSDP2 (fully_shard), the only version asyncgrpo runs"
        )
    reshard = getattr(plugin, "reshard_after_forward", True)
    if not isinstance(reshard, bool):  # FSDP1 expresses it as a sharding strategy
        reshard = "SHARD_GRAD_OP" not in str(reshard)
    state_dict_type = str(getattr(plugin, "state_dict_type", "") or "")
    if state_dict_type:
        kind = state_dict_type.rsplit(".", 1)[-1]
        notes.append(
            f"fsdp_state_dict_type ({kind}) is not read: checkpoint_format says how checkpoints are "
            "written (by default sharded, each process writing its own shards)"
        )
    if getattr(plugin, "activation_checkpointing", False):
        notes.append("fsdp_activation_checkpointing is not applied by FSDP here: use gradient_checkpointing")
    return FsdpLaunch(reshard_after_forward=reshard, notes=notes)


def announce(launch: FsdpLaunch) -> None:
    """One message on what an accelerate FSDP launch becomes here."""
    applied = f"fully_shard per decoder layer, reshard_after_forward={launch.reshard_after_forward}"
    message = f"accelerate FSDP config: asyncgrpo shards the model itself ({applied})"
    if launch.notes:
        message += "; " + "; ".join(launch.notes)
    logger.info(message)
