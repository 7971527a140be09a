"""What becomes of every `TrainingArguments` field in asyncgrpo: honoured, a warning, or refused.

AsyncGRPOTrainer runs its own loop and draws prompts from its own stream, so a field that only the
base Trainer's loop, data loader or evaluation loop reads would do nothing here, silently. Each field
of transformers' `TrainingArguments` has one entry in `TRAINING_ARGUMENTS`
(tests/unit/test_training_arguments.py fails when a transformers release adds a field this table does not
place; docs/configuration.md lists the same table):

- honoured: by this trainer's loop, or by the base Trainer's machinery it keeps (optimizer, scheduler,
  callbacks, logging, checkpoints, the launch); the text says how, and the limits that are refused by
  the config's own checks (training_arguments.py);
- warns: no effect here; set to a value that `warns_or_refuses` matches (by default: anything but the
  field's default) it warns once, saying why;
- refused: a ValueError at construction, saying why and what to set instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncgrpo.config.trl_compat import warn_once

HONOURED, WARNS, REFUSED = "honoured", "warns", "refused"
# Prompt orders the prompt stream can draw (asyncgrpo/rollout/prompts.py).
HONOURED_SAMPLING_STRATEGIES = ("random", "sequential")
# accelerator_config's settings of the base loop's data loader and gradient accumulation, and their
# defaults (use_configured_state, the other one, is honoured: transformers builds the accelerator).
_LOADER_ACCELERATOR_SETTINGS = {
    "split_batches": False,
    "dispatch_batches": None,
    "even_batches": True,
    "use_seedable_sampler": True,
    "non_blocking": False,
    "gradient_accumulation_kwargs": None,
}


@dataclass(frozen=True)
class Rule:
    kind: str  # HONOURED, WARNS or REFUSED
    text: str  # how it is honoured; or why it has no effect, or is refused (and what to set instead)
    # WARNS / REFUSED: whether the config's value warns or is refused. None: any value but the default.
    warns_or_refuses: Callable[[Any], bool] | None = None


def _honoured(text: str) -> Rule:
    return Rule(HONOURED, text)


def _warns(text: str, when: Callable[[Any], bool] | None = None) -> Rule:
    return Rule(WARNS, text, when)


def _refused(text: str, when: Callable[[Any], bool] | None = None) -> Rule:
    return Rule(REFUSED, text, when)


def _batch_size_without_effect(config) -> bool:
    budgeted = config.token_budget is None or config.token_budget > 0
    return budgeted and config.per_device_train_batch_size != _default(config, "per_device_train_batch_size")


def _sampling_without_effect(config) -> bool:
    strategy = getattr(config.train_sampling_strategy, "value", config.train_sampling_strategy)
    return strategy not in HONOURED_SAMPLING_STRATEGIES


def _accelerator_loader_settings(config) -> bool:
    value = config.accelerator_config
    if value is None:
        return False
    if isinstance(value, str):  # a JSON file, as TrainingArguments reads it
        from transformers.trainer_pt_utils import AcceleratorConfig

        value = AcceleratorConfig.from_json_file(value)
    get = value.get if isinstance(value, dict) else lambda name, default: getattr(value, name, default)
    return any(get(name, default) != default for name, default in _LOADER_ACCELERATOR_SETTINGS.items())


_OPTIMIZER = (
    "the optimizer the base Trainer builds from them (`optim`'s choice; its default runs as the Triton "
    "AdamW on CUDA, `triton_adamw`, with the same arguments)"
)
_EVAL_LOOP = (
    "it shapes the base Trainer's evaluation loop (a model forward over eval batches, compute_metrics); "
    "here evaluation samples the eval prompts on the servers and scores them with the reward functions"
)
_DATA_LOADER = "no data loader runs: prompts stream to the rollout worker, samples come from its queue"
_DDP = "several processes are sharded with FSDP2 by the trainer itself, never wrapped in DDP"
_SCRIPT = "read by your script, not by any Trainer (as in transformers)"

_RULES: dict[tuple[str, ...], Rule] = {
    ("output_dir",): _honoured("the run directory: checkpoints, config.json, metrics.jsonl, the timeline"),
    ("per_device_train_batch_size",): _warns(
        "with a token budget (token_budget None or > 0) rows are filled up to token_budget tokens (None: the "
        "server's max_model_len), however many samples that takes. It sets the samples per row only when "
        "token_budget <= 0 (TRL's fixed-count mode)",
        _batch_size_without_effect,
    ),
    ("num_train_epochs",): _honoured("with max_steps <= 0, epochs counted in prompts end training"),
    ("max_steps",): _honoured("optimizer steps of the run; > 0 replaces num_train_epochs"),
    (
        "learning_rate",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "optim",
        "optim_args",
        "optim_target_modules",
    ): _honoured(_OPTIMIZER),
    ("lr_scheduler_type", "lr_scheduler_kwargs"): _honoured(
        "the base Trainer's scheduler, stepped after each optimizer step; without max_steps > 0 only a "
        "constant schedule (`constant`, `constant_with_warmup`) is accepted"
    ),
    ("warmup_steps",): _honoured(
        "warm-up steps of the schedule; a fraction (< 1) of the run's steps needs max_steps > 0 (refused "
        "otherwise: the number of steps is not known in advance)"
    ),
    ("gradient_accumulation_steps",): _honoured("micro-batches of rows per optimizer step"),
    ("average_tokens_across_devices",): _warns(
        "the loss is always normalized by the trained tokens of all processes (what True means)"
    ),
    ("max_grad_norm",): _honoured("gradient clipping (0 or None: the norm is measured, not clipped)"),
    ("label_smoothing_factor",): _refused(
        "label smoothing changes a supervised cross-entropy, and the GRPO loss has no labels: leave it at 0"
    ),
    ("bf16", "fp16"): _honoured("autocast around the loss, as the base Trainer's mixed precision"),
    ("bf16_full_eval", "fp16_full_eval"): _warns(_EVAL_LOOP),
    ("tf32",): _honoured("set by TrainingArguments itself (a process-wide torch setting)"),
    ("gradient_checkpointing", "gradient_checkpointing_kwargs"): _honoured(
        "recompute activations in backward, enabled by the base Trainer with these keyword arguments "
        "(gradient_checkpointing_to_fit then picks the layers a row needs)"
    ),
    ("torch_compile", "torch_compile_backend", "torch_compile_mode"): _honoured(
        "regional compilation: each decoder layer compiled with this backend and mode (setting either "
        "turns torch_compile on, as in transformers)"
    ),
    ("use_liger_kernel",): _refused(
        "the loss needs its own log-prob computation (a chunked head over the trained tokens)"
    ),
    ("liger_kernel_config",): _warns("it configures use_liger_kernel, which asyncgrpo does not support"),
    ("use_cache",): _honoured(
        "set on model.config as transformers does; the packed training forward never caches"
    ),
    ("neftune_noise_alpha",): _refused(
        "NEFTune adds noise to the embeddings in training only, so the trainer's log-probs would no longer "
        "be those of the policy the server samples (the importance ratio would measure the noise): leave it "
        "None"
    ),
    ("torch_empty_cache_steps",): _honoured("the device cache is emptied every N optimizer steps"),
    ("auto_find_batch_size",): _refused(
        "rows are sized by token_budget, not by a batch size, and an out-of-memory error mid-run would "
        "restart the whole run; lower token_budget instead (gradient_checkpointing_to_fit already fits "
        "each row to the GPU's free memory)"
    ),
    ("logging_strategy", "logging_steps", "logging_first_step"): _honoured(
        "the logging schedule, by the base Trainer's callbacks (a fractional logging_steps needs max_steps "
        "> 0)"
    ),
    ("log_on_each_node", "log_level", "log_level_replica"): _honoured(
        "the transformers log verbosity of each process, set by the base Trainer"
    ),
    ("logging_nan_inf_filter",): _warns(
        "a non-finite loss or gradient always skips the optimizer step and the weight sync, and is "
        "counted in train/nonfinite_steps instead of being logged"
    ),
    ("include_num_input_tokens_seen",): _honoured(
        "counts the tokens of the packed rows (num_input_tokens_seen)"
    ),
    ("disable_tqdm",): _honoured("turns off the progress bar and the per-log line"),
    (
        "report_to",
        "run_name",
        "project",
        "trackio_space_id",
        "trackio_bucket_id",
        "trackio_static_space_id",
    ): _honoured(
        "the integrations' callbacks, which receive every logged window (and log_completions' table)"
    ),
    ("eval_strategy", "eval_steps", "eval_delay", "eval_on_start"): _honoured(
        "the evaluation schedule (a fractional eval_steps needs max_steps > 0)"
    ),
    ("per_device_eval_batch_size",): _warns(
        "the whole eval dataset is sent to the servers at once (bounded by max_concurrent_rollouts), and "
        "the servers batch it with the training rollouts"
    ),
    (
        "prediction_loss_only",
        "eval_do_concat_batches",
        "eval_use_gather_object",
        "eval_accumulation_steps",
        "include_for_metrics",
        "batch_eval_metrics",
    ): _warns(_EVAL_LOOP),
    ("save_only_model", "save_strategy", "save_steps", "save_total_limit"): _honoured(
        "checkpoints, written whole or not at all (a fractional save_steps needs max_steps > 0), in the "
        "layout checkpoint_format says"
    ),
    ("save_on_each_node",): _warns(
        "every process writes its shards into one checkpoint directory, which rank 0 renames into place "
        "once all are written; on several nodes, put output_dir on a filesystem they share"
    ),
    ("enable_jit_checkpoint",): _refused(
        "a checkpoint taken at any point of a step cannot record the rollout position and the held samples "
        "consistently (and ranks would save at different times); SIGTERM already stops a run cleanly: "
        "checkpoint with save_steps"
    ),
    (
        "push_to_hub",
        "hub_token",
        "hub_private_repo",
        "hub_model_id",
        "hub_strategy",
        "hub_always_push",
        "hub_revision",
    ): _honoured("each checkpoint is pushed as the base Trainer pushes it"),
    ("load_best_model_at_end", "metric_for_best_model", "greater_is_better"): _honoured(
        "the best evaluation's checkpoint, kept and loaded at the end (metric_for_best_model: an eval "
        "figure such as reward)"
    ),
    ("ignore_data_skip",): _refused(
        "resume repositions the rollout worker (rollout_state.json), not the base Trainer's data skipping: "
        "leave it True"
    ),
    ("restore_callback_states_from_checkpoint",): _honoured("callback states restored on resume"),
    ("full_determinism", "seed"): _honoured(
        "seeds (and deterministic algorithms) of the training processes, as the base Trainer sets them; "
        "seed also orders the prompts when data_seed is None"
    ),
    ("data_seed",): _honoured("seeds the prompt order"),
    ("use_cpu",): _honoured("trains on CPU; with several processes it forms their group"),
    ("accelerator_config",): _warns(
        "its data-loader and gradient-accumulation settings (split_batches, dispatch_batches, "
        "even_batches, use_seedable_sampler, non_blocking, gradient_accumulation_kwargs) configure the base "
        "loop's; use_configured_state is honoured",
        _accelerator_loader_settings,
    ),
    ("parallelism_config",): _honoured(
        "data parallelism (FSDP2 over every process); context, sequence and tensor parallelism are refused"
    ),
    (
        "dataloader_drop_last",
        "dataloader_num_workers",
        "dataloader_pin_memory",
        "dataloader_persistent_workers",
        "dataloader_prefetch_factor",
        "dataloader_multiprocessing_context",
        "dataloader_in_order",
    ): _warns(_DATA_LOADER),
    ("remove_unused_columns",): _refused("every dataset column reaches the reward functions: leave it False"),
    ("label_names",): _warns("there are no labels: rewards score the completions"),
    ("train_sampling_strategy",): _warns(
        "rows are packed from the rollout queue in the order groups finish generating, so samples cannot "
        "be batched by length; prompts are drawn shuffled, as with 'random' ('sequential' keeps the "
        "dataset's order)",
        _sampling_without_effect,
    ),
    ("length_column_name",): _warns(
        "it serves train_sampling_strategy='group_by_length', which has no effect"
    ),
    ("ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph"): _warns(
        _DDP
    ),
    ("ddp_backend", "ddp_timeout"): _honoured(
        "the process group of several processes, as accelerate forms it"
    ),
    ("fsdp", "fsdp_config"): _honoured(
        "read as an FSDP launch: the trainer shards with FSDP2 itself and applies reshard_after_forward "
        "(parameter offload is refused)"
    ),
    ("deepspeed",): _refused("use FSDP2 for sharded training (torchrun, or accelerate with an FSDP config)"),
    ("debug",): _honoured("the base Trainer's debug options (underflow_overflow hooks the model's modules)"),
    ("skip_memory_metrics",): _honoured("False adds the base Trainer's memory metrics to the run's last log"),
    ("do_train", "do_eval", "do_predict", "resume_from_checkpoint"): _honoured(_SCRIPT),
    ("local_rank",): _honoured("set by the launcher, as in transformers"),
    # Declared by asyncgrpo (TrainingArgumentsDefaults) for newer TrainingArguments and TRL's signature.
    ("activation_checkpointing", "activation_checkpointing_kwargs"): _warns(
        "activations are recomputed through gradient_checkpointing (True by default) and "
        "gradient_checkpointing_kwargs"
    ),
}
TRAINING_ARGUMENTS: dict[str, Rule] = {name: rule for names, rule in _RULES.items() for name in names}


def _default(config, name: str) -> Any:
    declared = {field.name: field for field in dataclasses.fields(config)}[name]
    if declared.default_factory is not dataclasses.MISSING:
        return declared.default_factory()
    return declared.default


def applies(config, name: str) -> bool:
    """Whether `name`'s value in `config` is one its WARNS / REFUSED rule is about."""
    rule = TRAINING_ARGUMENTS[name]
    if rule.warns_or_refuses is not None:
        return rule.warns_or_refuses(config)
    return getattr(config, name) != _default(config, name)


def apply_training_argument_rules(config, fail: Callable[[str], None]) -> None:
    """Warn once about each field set without effect, fail on the first one refused."""
    for name, rule in TRAINING_ARGUMENTS.items():
        if rule.kind == HONOURED or not applies(config, name):
            continue
        value = getattr(config, name)
        if rule.kind == REFUSED:
            fail(f"{name}={value!r} is not supported: {rule.text}")
        else:
            warn_once(name, f"{name}={value!r} has no effect in asyncgrpo: {rule.text}")
