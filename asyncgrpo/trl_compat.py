"""Config fields of TRL 1.16's AsyncGRPOConfig that this trainer has under another name, or not at all.

A TRL script that only changes its import must construct its config unchanged. Each field here is
either mapped onto the equivalent setting (`max_inflight_tasks`, `heartbeat_stale_after_s`) or, where
the mechanism it tunes does not exist in this trainer, accepted with a warning (once per process)
saying why it has no effect. Fields that are real behaviour here (`repetition_penalty`,
`request_timeout`, `weight_sync_timeout`) live with the others in `asyncgrpo.config`.

The same goes for the TrainingArguments fields (TRL's config inherits them) that a data loader or the
base Trainer's loop would read, which this trainer replaces: those it cannot honour warn when set.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# TRL 1.16's defaults, which also mean "not set" for the fields that only warn.
TRL_QUEUE_MAXSIZE = 1024
TRL_FORK_THRESHOLD_TOKENS = 1024
TRL_HEARTBEAT_STALE_AFTER_S = 300.0
# transformers' default, which means "not set".
PER_DEVICE_TRAIN_BATCH_SIZE = 8
# Prompt orders the prompt stream can draw (asyncgrpo/rollout/prompts.py).
HONOURED_SAMPLING_STRATEGIES = ("random", "sequential")

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
            raise ValueError(
                f"AsyncGRPOConfig: max_inflight_tasks={self.max_inflight_tasks} must be -1 (auto) or >= 1"
            )
        if self.max_inflight_tasks > 0:
            if self.max_concurrent_rollouts not in (default_concurrency, self.max_inflight_tasks):
                raise ValueError(
                    f"AsyncGRPOConfig: max_inflight_tasks={self.max_inflight_tasks} and "
                    f"max_concurrent_rollouts={self.max_concurrent_rollouts} set the same limit: give only "
                    "one of them"
                )
            self.max_concurrent_rollouts = self.max_inflight_tasks
        if self.heartbeat_stale_after_s != TRL_HEARTBEAT_STALE_AFTER_S:
            if self.rollout_worker_timeout not in (default_worker_timeout, self.heartbeat_stale_after_s):
                raise ValueError(
                    f"AsyncGRPOConfig: heartbeat_stale_after_s={self.heartbeat_stale_after_s} and "
                    f"rollout_worker_timeout={self.rollout_worker_timeout} set the same limit: give only one "
                    "of them"
                )
            self.rollout_worker_timeout = self.heartbeat_stale_after_s
        if self.queue_maxsize != TRL_QUEUE_MAXSIZE:
            _warn_once(
                "queue_maxsize",
                f"queue_maxsize={self.queue_maxsize} has no effect in asyncgrpo: generated samples are "
                "bounded by max_staleness (in tokens: at most max_staleness x a step's tokens queued or in "
                "flight)",
            )
        if self.fork_threshold_tokens != TRL_FORK_THRESHOLD_TOKENS:
            _warn_once(
                "fork_threshold_tokens",
                f"fork_threshold_tokens={self.fork_threshold_tokens} has no effect in asyncgrpo: a turn "
                "that re-renders kept tokens always starts a new training sequence (nothing is realigned "
                "as context)",
            )
        self._warn_about_training_arguments()

    def _warn_about_training_arguments(self) -> None:
        """TrainingArguments fields that only the base Trainer's data loader or loop would read."""
        if self.per_device_train_batch_size != PER_DEVICE_TRAIN_BATCH_SIZE and (
            self.token_budget is None or self.token_budget > 0
        ):
            _warn_once(
                "per_device_train_batch_size",
                f"per_device_train_batch_size={self.per_device_train_batch_size} has no effect with "
                f"token_budget={self.token_budget}: rows are filled up to token_budget tokens (None: the "
                "server's max_model_len), however many samples that takes. It sets the samples per row only "
                "when token_budget <= 0 (TRL's fixed-count mode)",
            )
        if self.train_sampling_strategy not in HONOURED_SAMPLING_STRATEGIES:
            _warn_once(
                "train_sampling_strategy",
                f"train_sampling_strategy={self.train_sampling_strategy!r} has no effect in asyncgrpo: rows "
                "are packed from the rollout queue in the order groups finish generating, so samples "
                "cannot be batched by length; prompts are drawn shuffled, as with 'random' ('sequential' "
                "keeps the dataset's order)",
            )
        if self.save_on_each_node:
            _warn_once(
                "save_on_each_node",
                "save_on_each_node=True has no effect in asyncgrpo: rank 0 gathers the full model and "
                "optimizer states and writes every checkpoint alone; on several nodes, put output_dir on a "
                "filesystem they share",
            )


def _warn_once(name: str, message: str) -> None:
    if name not in _warned:
        _warned.add(name)
        logger.warning(message)
