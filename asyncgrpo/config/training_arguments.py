"""TrainingArguments fields whose default this trainer changes, and the checks of TrainingArguments
settings: each field's rule (training_arguments_table.py: honoured, a warning, or refused) and the
limits of the honoured ones (its own loop replaces the base Trainer's data loader, schedule and
parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from asyncgrpo.config.training_arguments_table import apply_training_argument_rules


@dataclass
class TrainingArgumentsDefaults:
    """TrainingArguments defaults this trainer overrides (their fields keep TrainingArguments' place)."""

    logging_steps: float = field(
        default=1,
        metadata={"help": "Optimizer steps per logging window (default 1: RL runs are read step by step)."},
    )
    gradient_checkpointing: bool = field(
        default=True,
        metadata={
            "help": "Recompute activations in backward. True: rows of token_budget tokens need it to fit in "
            "memory."
        },
    )
    gradient_checkpointing_to_fit: bool | None = field(
        default=None,
        metadata={
            "help": "With gradient_checkpointing, checkpoint only as many decoder layers as each row needs "
            "to fit the GPU's free memory (the recomputed forward costs about a third of a step). None: "
            "True on a CUDA GPU with one process, else False (every layer checkpointed)."
        },
    )
    torch_compile: bool | None = field(
        default=None,
        metadata={
            "help": "Compile each decoder layer (fused norms, rotary and activations: a faster fwd+bwd on a "
            "GPU, docs/gpu-performance.md). None: True when a CUDA GPU trains, else False (compiling on CPU "
            "is slow to start)."
        },
    )
    triton_adamw: bool = field(
        default=True,
        metadata={
            "help": "True: on a CUDA GPU, run the default optimizer (optim='adamw_torch_fused') as "
            "asyncgrpo's Triton AdamW: the same update, arguments, state and checkpoints, at the card's "
            "memory bandwidth (the optimizer step is the part of a step packing cannot shrink). False: "
            "torch's fused AdamW. Other optimizers and devices are never replaced."
        },
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "Mixed precision in bfloat16. None: True when fp16 is unset and the training device "
            "supports bf16 (a CUDA GPU), else False, so the same script runs on a CPU-only machine."
        },
    )
    learning_rate: float = field(
        default=1e-6,
        metadata={
            "help": "Peak learning rate (scales each optimizer step). 1e-6: RL fine-tuning moves a "
            "pretrained policy gently."
        },
    )
    lr_scheduler_type: str = field(
        default="constant",
        metadata={
            "help": "Learning-rate schedule. constant: the number of optimizer steps per epoch is unknown in "
            "advance (it depends on forks and dropped groups); a decaying schedule needs max_steps > 0."
        },
    )
    ignore_data_skip: bool = field(
        default=True,
        metadata={
            "help": "Must stay True: resume repositions the rollout worker (rollout_state.json) instead."
        },
    )
    remove_unused_columns: bool = field(
        default=False,
        metadata={"help": "Must stay False: every dataset column reaches the reward functions."},
    )
    # Newer TrainingArguments have these two; declared here so TRL's signature exists on every version.
    activation_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Accepted for TRL compatibility; no effect (default None; any other value warns once): "
            "this trainer shards with FSDP2 itself and recomputes activations through gradient_checkpointing."
        },
    )
    activation_checkpointing_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Accepted for TRL compatibility; no effect (see activation_checkpointing); None, any "
            "other value warns once: gradient_checkpointing_kwargs passes options to the recomputation."
        },
    )

    def _resolve_training_arguments(self) -> None:
        if self.bf16 is None:
            self.bf16 = not self.fp16 and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        on_gpu = torch.cuda.is_available() and not self.use_cpu
        if self.torch_compile is None:
            self.torch_compile = on_gpu
        if self.gradient_checkpointing_to_fit is None:
            self.gradient_checkpointing_to_fit = on_gpu

    def _validate_training_arguments(self, fail) -> None:
        apply_training_argument_rules(self, fail)
        self._validate_schedule(fail)
        self._validate_parallelism(fail)

    def _validate_schedule(self, fail) -> None:
        """Without max_steps, epochs end training and the number of steps is unknown in advance
        (it depends on forks and dropped groups): nothing may be sized from it."""
        if self.max_steps > 0:
            return
        fractions = {
            name: getattr(self, name)
            for name in ("logging_steps", "save_steps", "eval_steps")
            if getattr(self, name) is not None and 0 < getattr(self, name) < 1
        }
        if fractions:
            given = ", ".join(f"{name}={value}" for name, value in fractions.items())
            fail(
                f"{given}: logging_steps/save_steps/eval_steps given as a fraction of training need "
                "max_steps > 0: the number of steps in an epoch is not known in advance; give a whole number "
                "of steps"
            )
        if 0 < self.warmup_steps < 1:
            fail(
                f"warmup_steps={self.warmup_steps} is a fraction of the run's steps, which are not known "
                "in advance without max_steps (they depend on forks and dropped groups): the warm-up would "
                "never end. Give warmup_steps as a whole number of optimizer steps (e.g. 10), or set "
                "max_steps > 0"
            )
        schedule = getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type)
        if schedule not in ("constant", "constant_with_warmup"):
            fail(
                f"lr_scheduler_type={schedule!r} decays over max_steps, which epochs cannot give (the number "
                "of steps depends on forks and drops): set max_steps, or use a constant schedule"
            )

    def _validate_parallelism(self, fail) -> None:
        """Tree-packed rows are split between processes by data parallelism only."""
        config = self.parallelism_config
        if config is None:
            return
        for name in ("cp_size", "sp_size", "tp_size"):
            if (getattr(config, name, 1) or 1) > 1:
                fail(
                    f"parallelism_config.{name}={getattr(config, name)} is not supported: context, sequence "
                    "and tensor parallelism do not apply to tree-packed rows; use FSDP2 (data parallel) only"
                )
