"""Config fields of TRL 1.16's AsyncGRPOConfig that this trainer has under another name, or not at all.

A TRL script that only changes its import must construct its config unchanged. Each field here is
either mapped onto the equivalent setting (`max_inflight_tasks`, `heartbeat_stale_after_s`) or, where
the mechanism it tunes does not exist in this trainer, accepted with a warning (once per process)
saying why it has no effect. Fields that are real behaviour here (`repetition_penalty`,
`request_timeout`, `weight_sync_timeout`) live with the others in `asyncgrpo.config`.

`warn_once` is also how the TrainingArguments fields without effect here warn
(asyncgrpo/config/training_arguments_table.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from asyncgrpo.errors import ConfigurationError

logger = logging.getLogger(__name__)

# TRL 1.16's defaults, which also mean "not set" for the fields that only warn.
TRL_QUEUE_MAXSIZE = 1024
TRL_FORK_THRESHOLD_TOKENS = 1024
TRL_HEARTBEAT_STALE_AFTER_S = 300.0

_warned: set[str] = set()


@dataclass
class TrlCompatFields:
    max_inflight_tasks: int = field(
        default=-1,
        metadata={
            "help": "TRL's name for max_concurrent_rollouts: a value > 0 sets it. -1 (auto) leaves "
            "max_concurrent_rollouts in charge, under which max_staleness (in tokens) and the server's "
            "KV-cache usage already size generation automatically."
        },
    )
    queue_maxsize: int = field(
        default=TRL_QUEUE_MAXSIZE,
        metadata={
            "help": "Accepted for TRL scripts; no effect here (warns when changed): the queue of generated "
            "samples is bounded by max_staleness, in tokens, not by a count of samples. 1024 (samples): "
            "TRL's default, i.e. unset."
        },
    )
    heartbeat_stale_after_s: float = field(
        default=TRL_HEARTBEAT_STALE_AFTER_S,
        metadata={
            "help": "TRL's name for rollout_worker_timeout (seconds without a heartbeat before aborting). "
            "300 (TRL's default) leaves rollout_worker_timeout in charge."
        },
    )
    fork_threshold_tokens: int = field(
        default=TRL_FORK_THRESHOLD_TOKENS,
        metadata={
            "help": "Accepted for TRL scripts; no effect here (warns when changed): a multi-turn turn whose "
            "prompt re-renders kept tokens always starts a new training sequence, so no drift is realigned "
            "and no threshold applies. 1024 (tokens): TRL's default, i.e. unset."
        },
    )

    def _apply_trl_compat(self, default_concurrency: int, default_worker_timeout: float) -> None:
        """Map TRL's names onto ours (a conflict between the two is a ValueError), warn about the
        fields without effect. Called by AsyncGRPOConfig.__post_init__ before validation."""
        if self.max_inflight_tasks == 0 or self.max_inflight_tasks < -1:
            raise ConfigurationError(
                f"AsyncGRPOConfig: max_inflight_tasks={self.max_inflight_tasks} must be -1 (auto) or >= 1"
            )
        if self.max_inflight_tasks > 0:
            if self.max_concurrent_rollouts not in (default_concurrency, self.max_inflight_tasks):
                raise ConfigurationError(
                    f"AsyncGRPOConfig: max_inflight_tasks={self.max_inflight_tasks} and "
                    f"max_concurrent_rollouts={self.max_concurrent_rollouts} set the same limit: give only "
                    "one of them"
                )
            self.max_concurrent_rollouts = self.max_inflight_tasks
        if self.heartbeat_stale_after_s != TRL_HEARTBEAT_STALE_AFTER_S:
            if self.rollout_worker_timeout not in (default_worker_timeout, self.heartbeat_stale_after_s):
                raise ConfigurationError(
                    f"AsyncGRPOConfig: heartbeat_stale_after_s={self.heartbeat_stale_after_s} and "
                    f"rollout_worker_timeout={self.rollout_worker_timeout} set the same limit: give only one "
                    "of them"
                )
            self.rollout_worker_timeout = self.heartbeat_stale_after_s
        if self.queue_maxsize != TRL_QUEUE_MAXSIZE:
            warn_once(
                "queue_maxsize",
                f"queue_maxsize={self.queue_maxsize} has no effect in asyncgrpo: generated samples are "
                "bounded by max_staleness (in tokens: at most max_staleness x a step's tokens queued or in "
                "flight)",
            )
        if self.fork_threshold_tokens != TRL_FORK_THRESHOLD_TOKENS:
            warn_once(
                "fork_threshold_tokens",
                f"fork_threshold_tokens={self.fork_threshold_tokens} has no effect in asyncgrpo: a turn "
                "that re-renders kept tokens always starts a new training sequence (nothing is realigned "
                "as context)",
            )


def warn_once(name: str, message: str) -> None:
    """Log `message` the first time `name` warns in this process (a config built again stays quiet)."""
    if name not in _warned:
        _warned.add(name)
        logger.warning(message)
