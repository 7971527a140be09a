"""AsyncGRPOTrainer: asynchronous GRPO on top of transformers.Trainer.

A rollout worker (spawned process) generates and scores groups against vLLM while this loop trains.
One optimizer step (`_train_step`) reads top to bottom:
  take samples (drop the stale) -> plan rows -> forward/backward with tree attention -> optimizer
  -> weight sync every `weight_sync_steps` -> allowance and metrics.
Logging, checkpointing and callbacks go through the base Trainer's machinery, so `report_to`,
`save_strategy`, `resume_from_checkpoint` and user callbacks behave as usual.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedModel, Trainer, TrainerState
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.trainer import OPTIMIZER_NAME as OPTIMIZER_FILE
from transformers.trainer import SCHEDULER_NAME as SCHEDULER_FILE
from transformers.trainer import TRAINER_STATE_NAME as TRAINER_STATE_FILE
from transformers.trainer_utils import TrainOutput, rotate_checkpoints

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.generation.background import BackgroundLoop
from asyncgrpo.generation.client import VLLMClient
from asyncgrpo.trainer.intake import SampleIntake, StepBatch, TrainingComplete
from asyncgrpo.logprobs import row_logprobs
from asyncgrpo.models import freeze_outside_language_model, load_model, router_aux_loss_coef
from asyncgrpo.loss import LossInputs, clipped_surrogate_loss, score_centered_loss
from asyncgrpo.metrics import MetricsWindow, Reduce, Stat
from asyncgrpo.packing.tree_attention import enable_tree_attention, padded_length
from asyncgrpo.perf import device_peak_flops, flop_model
from asyncgrpo.trainer.progress import AsyncProgressCallback
from asyncgrpo.trainer.prompt_ledger import PromptLedger, RolloutState
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.types import Rollout, RolloutGroup, TrainingSequence, TurnRecord
from asyncgrpo.rollout.worker import RolloutWorker, check_worker_payload
from asyncgrpo.trainer.compile import compile_decoder_layers
from asyncgrpo.trainer.distributed import Processes, full_state, load_optimizer_state, local_value, shard_model
from asyncgrpo.trainer.checks import (
    check_conversational,
    check_launch,
    check_multi_process,
    check_parallelism,
    check_prompt_lengths,
    check_reward_funcs,
    check_transformers_version,
)
from asyncgrpo.weight_sync import non_sending_weight_sync
from asyncgrpo.weight_sync.filesystem import FilesystemWeightSync
from asyncgrpo.weight_sync.nccl import NcclWeightSync, server_transfer_backend, vllm_at_least
from asyncgrpo.weight_sync.transport import NcclTransport

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


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
    ):
        check_transformers_version()
        model_id = model if isinstance(model, str) else model.config._name_or_path
        if args is None:
            args = AsyncGRPOConfig(output_dir=f"{Path(model_id).name or 'model'}-AsyncGRPO")
        if reward_funcs is None:
            reward_funcs = []
        elif not isinstance(reward_funcs, (list, tuple)):
            reward_funcs = [reward_funcs]
        check_reward_funcs(list(reward_funcs))
        check_parallelism(args)
        if tools or environment_factory is not None:
            raise NotImplementedError(
                "tools and environment_factory (agent training) are not available in this version yet"
            )
        if not reward_funcs:
            raise ValueError("reward_funcs is empty: give at least one reward function")
        if train_dataset is None:
            raise ValueError("train_dataset is required (it must have a conversational 'prompt' column)")
        streaming = not hasattr(train_dataset, "__len__")
        if streaming and args.max_steps <= 0:
            raise ValueError("an IterableDataset has no length, so epochs cannot end training: set max_steps > 0")
        if args.max_steps <= 0 and any(0 < steps < 1 for steps in (args.logging_steps, args.save_steps)):
            raise ValueError(
                "logging_steps/save_steps given as a fraction of training need max_steps > 0: the number of "
                "steps in an epoch is not known in advance"
            )
        if args.max_steps <= 0 and args.lr_scheduler_type not in ("constant", "constant_with_warmup"):
            raise ValueError(
                f"lr_scheduler_type={args.lr_scheduler_type!r} decays over max_steps, which epochs cannot give "
                "(the number of steps depends on forks and drops): set max_steps, or use a constant schedule"
            )
        check_conversational(train_dataset, environment_factory)
        if isinstance(model, str):
            model = self._load_model(model, args)
        if peft_config is not None:
            raise NotImplementedError("PEFT adapters are not available in this version yet")
        frozen = freeze_outside_language_model(model)  # a vision tower: text-only training never uses it
        if frozen:
            logger.info("froze %d parameters outside the language model (vision tower)", len(frozen))
        args.router_aux_loss_coef = router_aux_loss_coef(model.config, args.router_aux_loss_coef)
        enable_tree_attention(model)  # refuses attention sinks and layers it cannot pack
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(
                model_id, trust_remote_code=args.trust_remote_code, padding_side="left"
            )
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token

        # torch_compile means regional compilation of the decoder layers here (trainer/compile.py); the
        # base Trainer would compile the whole model, whose forward this trainer does not call.
        self._compile_layers = args.torch_compile
        args.torch_compile = False
        self.reward_funcs = list(reward_funcs)
        self.model_id = model_id
        self.streaming = streaming
        self._loss_fn = score_centered_loss if args.score_centering else clipped_surrogate_loss
        self._progress = AsyncProgressCallback(
            total=args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * len(train_dataset)),
            unit="step" if args.max_steps > 0 else "prompt",
        )
        super().__init__(
            model=model,
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            callbacks=list(callbacks or []) + [self._progress],
            optimizers=optimizers,
        )
        self.remove_callback(ProgressCallback)
        self.remove_callback(PrinterCallback)

    @staticmethod
    def _load_model(model_id: str, args: AsyncGRPOConfig) -> PreTrainedModel:
        kwargs = dict(args.model_init_kwargs or {})
        kwargs.setdefault("dtype", _DTYPES[args.dtype])
        kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        return load_model(model_id, **kwargs)

    # -- the training loop ----------------------------------------------------------------------------

    def _inner_training_loop(
        self, batch_size=None, args=None, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None
    ) -> TrainOutput:
        args = args or self.args
        check_launch(self.accelerator.num_processes, args.use_cpu)
        self._processes = Processes(self.accelerator.num_processes, self.accelerator.process_index)
        if self._processes.distributed:
            check_multi_process(self.is_fsdp_enabled or self.is_deepspeed_enabled, self.optimizer is not None)
        self.accelerator.free_memory()
        rollout_state = self._restore_state(args, resume_from_checkpoint)
        if self._processes.distributed:
            # FSDP2 applied here, not by accelerate: the packed forward must be registered with it.
            shard_model(self.model)  # the checkpoint's weights are already in (Trainer.train loads them)
            self.create_optimizer_and_scheduler(num_training_steps=self.state.max_steps)
            model = self.model_wrapped = self.model
            if resume_from_checkpoint:
                self._load_sharded_optimizer(resume_from_checkpoint)
        else:
            model, _ = self._prepare_for_training(self.state.max_steps, None, resume_from_checkpoint)
        if self._compile_layers:
            compile_decoder_layers(self.accelerator.unwrap_model(model))
        self.state.init_training_references(self, self.state.max_steps, args.num_train_epochs, trial)
        started = time.time()
        self._initial_global_step = self.state.global_step
        try:
            self._setup_generation(args, rollout_state)
            self._flops = flop_model(self.model)
            self._peak_flops = device_peak_flops(self.args.device, self._compute_dtype())
            self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
            self._sync_weights(model)  # the server runs exactly the weights training starts from
            while not self._processes.broadcast(self._should_stop(args) if self._processes.is_main else None):
                self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                try:
                    self._train_step(model)
                except TrainingComplete:  # the last prompts were consumed while the step waited
                    break
                self.state.global_step += 1
                self.state.epoch = self._processes.broadcast(self._epoch() if self._processes.is_main else None)
                self._progress.advance_to(self.state.global_step if args.max_steps > 0 else self._ledger.consumed_prompts)
                self.control = self.callback_handler.on_step_end(args, self.state, self.control)
                if self.control.should_log:
                    self._log_window()
                if self.control.should_save:
                    self._save_checkpoint(model, trial)
                    self.control = self.callback_handler.on_save(args, self.state, self.control)
                if self.control.should_training_stop:
                    break
        finally:
            self._teardown_generation()
        runtime = time.time() - started
        steps = self.state.global_step - self._initial_global_step
        train_loss = self._train_loss_sum / max(steps, 1)
        metrics = {"train_runtime": runtime, "train_steps_per_second": steps / max(runtime, 1e-9), "train_loss": train_loss}
        self.log(metrics)
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        return TrainOutput(self.state.global_step, train_loss, metrics)

    def _restore_state(self, args: AsyncGRPOConfig, checkpoint: str | None) -> RolloutState:
        max_steps = args.max_steps if args.max_steps > 0 else 2**62  # epochs end training (_should_stop)
        self.state = TrainerState(
            stateful_callbacks=[cb for cb in self.callback_handler.callbacks + [self.control] if hasattr(cb, "state")]
        )
        self.state.train_batch_size = self._train_batch_size
        self.state.max_steps = max_steps
        self.state.compute_steps(args, max_steps)
        rollout_state = RolloutState()
        if checkpoint is not None:
            state_file = Path(checkpoint) / "trainer_state.json"
            if state_file.exists():
                self.state = TrainerState.load_from_json(str(state_file))
                self.state.max_steps = max_steps
                self._load_callback_state()
            restored = RolloutState.load(checkpoint)
            if restored is None:
                logger.warning("%s has no rollout_state.json: the rollout worker restarts at the first prompt", checkpoint)
            else:
                rollout_state = restored
            if self.streaming:
                rollout_state.first_untrained_index, rollout_state.consumed_after = 0, []
        self._model_version = rollout_state.model_version
        self._num_tokens = rollout_state.num_tokens
        self._ledger = PromptLedger(
            rollout_state.first_untrained_index, rollout_state.consumed_after, rollout_state.consumed_prompts
        )
        self._train_loss_sum = 0.0
        self._window = MetricsWindow()
        return rollout_state

    def _setup_generation(self, args: AsyncGRPOConfig, rollout_state: RolloutState) -> None:
        """Reach the servers, size the rows, start the rollout worker and the weight-sync backend
        (rank 0); the other processes learn the row size and the backend from it."""
        self._worker = self._weight_sync = self._http = None  # what `_teardown_generation` closes, once open
        if not self._processes.is_main:
            self.token_budget, backend = self._processes.broadcast(None)
            self._weight_sync = non_sending_weight_sync(backend)
            return
        check_worker_payload(self.reward_funcs, self.loop_cls)  # before anything slow: a lambda fails here
        self._http = BackgroundLoop()
        self._client = VLLMClient(args.vllm_server_urls, timeout=args.vllm_server_timeout)
        logger.info("waiting for the vLLM server at %s", ", ".join(args.vllm_server_urls))
        self._http.run(self._client.wait_until_ready())
        max_model_len = self._http.run(self._client.max_model_len())
        served_name = self._http.run(self._client.model_name())
        server_info = self._http.run(self._client.server_info())
        self._warn_on_dtype_mismatch(server_info)
        self.token_budget = args.token_budget or max_model_len
        check_prompt_lengths(self.train_dataset, self._prompt_length, max_model_len)
        self._weight_sync = self._make_weight_sync(args, server_info)
        self._worker = RolloutWorker(
            self.loop_cls,
            dict(
                config=args,
                model_name=served_name,
                dataset=self.train_dataset,
                reward_funcs=self.reward_funcs,
                processing_class=self.processing_class,
                eos_token_ids=self._eos_token_ids(),
                dataset_start_index=rollout_state.first_untrained_index,
                skip_stream_indices=frozenset(rollout_state.consumed_after),
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
            prompts_per_epoch=None if self.streaming else len(self.train_dataset),
            stop_condition=lambda: self._should_stop(args),
        )
        self._worker.publish_model_version(self._model_version)
        self._worker.start(ready_timeout=args.vllm_server_timeout + 300)
        self._processes.broadcast((self.token_budget, self._weight_sync.name))

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

    def _make_weight_sync(self, args: AsyncGRPOConfig, server_info: dict | None):
        backend = args.weight_sync_backend
        server_has_nccl = server_transfer_backend(server_info) == "nccl"
        if backend == "auto":
            backend = "nccl" if server_has_nccl and self.args.device.type == "cuda" else "filesystem"
        if backend == "filesystem":
            return FilesystemWeightSync(self._client, self._http, Path(args.output_dir) / ".vllm_weights")
        if server_info is not None and not server_has_nccl:
            raise ValueError(
                "weight_sync_backend='nccl' but the vLLM server was not started with the NCCL engine: serve with "
                "--weight-transfer-config '{\"backend\": \"nccl\"}' (`asyncgrpo serve` does on GPU)"
            )
        rendezvous = "unique_id" if vllm_at_least(self._http.run(self._client.version()), (0, 30)) else "tcp_store"
        logger.info("weight sync: NCCL broadcast to the vLLM workers (%s rendezvous)", rendezvous)
        return NcclWeightSync(self._client, self._http, NcclTransport(rendezvous), args.vllm_server_timeout)

    def _should_stop(self, args: AsyncGRPOConfig) -> bool:
        if args.max_steps > 0:
            return self.state.global_step >= args.max_steps
        return self._ledger.consumed_prompts >= math.ceil(args.num_train_epochs * len(self.train_dataset))

    def _epoch(self) -> float:
        if self.streaming:
            return float(self.state.global_step) / max(self.args.max_steps, 1)
        return self._ledger.consumed_prompts / len(self.train_dataset)

    # -- one optimizer step ---------------------------------------------------------------------------

    def _train_step(self, model) -> None:
        args, metrics = self.args, self._window
        started = time.perf_counter()
        batch = self._processes.broadcast(self._next_batch() if self._processes.is_main else None)
        if batch is None:
            raise TrainingComplete()
        fwd_s, fwd_bwd_s, loss = self._forward_backward(model, batch)
        optimizer_s = self._optimizer_step(model)
        if (self.state.global_step + 1) % args.weight_sync_steps == 0:
            self._model_version += 1
            self._sync_weights(model)
        self._train_loss_sum += loss
        self._record_step(batch, loss, fwd_s, fwd_bwd_s, optimizer_s, time.perf_counter() - started)
        if self._worker is not None:
            for stats in self._worker.drain_metrics():
                metrics.merge(stats)

    def _next_batch(self) -> StepBatch | None:
        """Rank 0: the step's samples, planned into rows for every process; None once training is
        complete (the last prompts were consumed while waiting)."""
        try:
            return self._intake.next_step(self.args.gradient_accumulation_steps, self._window, self._model_version)
        except TrainingComplete:
            return None

    def _forward_backward(self, model, batch: StepBatch) -> tuple[float, float, float]:
        """Tree-packed forward and backward of every micro-batch; returns (fwd_s, fwd_bwd_s, loss)."""
        args = self.args
        fwd_s = fwd_bwd_s = loss_total = 0.0
        world, rank = self._processes.world_size, self._processes.rank
        row_stats = []
        for plan in batch.plans:
            rows = plan.pack()
            row, weight = rows[rank], 1.0
            entries_global = float(sum(r.num_entries for r in rows))
            if row.num_entries == 0:
                if not self._processes.distributed:
                    continue
                # FSDP2 needs every rank in every forward/backward: borrow a row, count it zero times.
                row, weight = next(r for r in rows if r.num_entries), 0.0
            started = self._now()
            with self.compute_loss_context_manager():
                loss, stats = row_loss(model, row, entries_global, args, self._loss_fn)
            forward_done = self._now()
            # FSDP2 averages gradients over processes; the loss is already normalized globally.
            self.accelerator.backward(loss * (world * weight))
            done = self._now()
            fwd_s += forward_done - started
            fwd_bwd_s += done - started
            if weight:
                loss_total += float(loss.detach())
                row_stats.append({name: Stat(s.reduce, float(s.value), float(s.weight)) for name, s in stats.items()})
        gathered = self._processes.gather((loss_total, row_stats))
        for _, stats_of_rank in gathered:
            for stats in stats_of_rank:
                self._window.merge(stats)
        return fwd_s, fwd_bwd_s, sum(rank_loss for rank_loss, _ in gathered)

    def _optimizer_step(self, model) -> float:
        started = self._now()
        max_norm = self.args.max_grad_norm if self.args.max_grad_norm and self.args.max_grad_norm > 0 else math.inf
        grad_norm = self.accelerator.clip_grad_norm_(model.parameters(), max_norm)  # inf: measure only
        self._window.record("grad_norm", local_value(grad_norm))
        self.optimizer.step()
        self.lr_scheduler.step()
        model.zero_grad(set_to_none=True)
        return self._now() - started

    def _sync_weights(self, model) -> None:
        timings = self._weight_sync.sync(self.accelerator.unwrap_model(model), self._model_version)
        if self._worker is not None:
            self._worker.publish_model_version(self._model_version)
        self._window.record("perf/weight_sync_s", timings.total_s)
        self._window.record("perf/weight_sync_pause_s", timings.pause_s)
        self._window.record("perf/weight_sync_barrier_s", timings.barrier_s)
        self._window.record("perf/weight_sync_transfer_s", timings.transfer_s)

    def _record_step(self, batch: StepBatch, loss: float, fwd_s: float, fwd_bwd_s: float, optimizer_s: float, step_s: float) -> None:
        window = self._window
        rows = [row for plan in batch.plans for row in plan.tries]
        forwarded = sum(plan_tokens for plan in batch.plans for plan_tokens in plan.row_tokens)
        unpacked = sum(sample.num_tokens for sample in batch.samples)
        trained = sum(sample.num_trained for sample in batch.samples)
        attention_pairs = sum(cost for plan in batch.plans for cost in plan.row_attention_costs)
        padded = sum(padded_length(tokens) for plan in batch.plans for tokens in plan.row_tokens if tokens)
        self._num_tokens += forwarded
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
        self.log({name: value for name, value in logs.items() if not (isinstance(value, float) and math.isnan(value))})

    def _print_completions(self) -> None:
        from asyncgrpo.trainer.completions_table import print_completions

        samples = getattr(self, "_recent_samples", [])
        print_completions(samples[-(self.args.num_completions_to_print or len(samples)) :], self.processing_class, self.state.global_step)
        self._recent_samples = []

    # -- checkpoints --------------------------------------------------------------------------------------

    def _save_checkpoint(self, model, trial) -> None:
        """The base checkpoint plus rollout_state.json, written first and atomically."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        run_directory = Path(self._get_output_dir(trial=trial))
        directory = run_directory / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self._processes.distributed:
            self._save_sharded_checkpoint(model, directory, run_directory)
            return
        directory.mkdir(parents=True, exist_ok=True)
        self._save_rollout_state(directory)
        super()._save_checkpoint(model, trial)

    def _save_rollout_state(self, directory: Path) -> None:
        watermark, consumed_after = self._ledger.state()
        RolloutState(
            first_untrained_index=watermark,
            consumed_after=consumed_after,
            consumed_prompts=self._ledger.consumed_prompts,
            model_version=self._model_version,
            num_tokens=self._num_tokens,
        ).save(directory)

    def _save_sharded_checkpoint(self, model, directory: Path, run_directory: Path) -> None:
        """Every rank helps gather the full model and optimizer states; rank 0 writes a checkpoint
        with the same files a single-process run writes."""
        model_state, optimizer_state = full_state(model, self.optimizer)
        if self._processes.is_main:
            directory.mkdir(parents=True, exist_ok=True)
            self._save_rollout_state(directory)
            self.model.save_pretrained(directory, state_dict=model_state)
            self.processing_class.save_pretrained(directory)
            torch.save(optimizer_state, directory / OPTIMIZER_FILE)
            torch.save(self.lr_scheduler.state_dict(), directory / SCHEDULER_FILE)
            self.state.save_to_json(str(directory / TRAINER_STATE_FILE))
            rotate_checkpoints(
                output_dir=str(run_directory),
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
            )
        self._processes.gather(None)  # no rank runs ahead of a checkpoint being written

    def _load_sharded_optimizer(self, checkpoint: str) -> None:
        load_optimizer_state(self.model, self.optimizer, torch.load(Path(checkpoint) / OPTIMIZER_FILE, weights_only=False))
        self.lr_scheduler.load_state_dict(torch.load(Path(checkpoint) / SCHEDULER_FILE, weights_only=False))

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
        rendered = self.processing_class.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, **(self.args.chat_template_kwargs or {})
        )
        return len(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)

    def _warn_on_dtype_mismatch(self, server_info: dict | None) -> None:
        model_config = ((server_info or {}).get("vllm_config") or {}).get("model_config") or {}
        served = str(model_config.get("dtype", "")).replace("torch.", "")
        trained = str(next(self.model.parameters()).dtype).replace("torch.", "")
        if served and served != trained:
            logger.warning(
                "the vLLM server runs %s weights but the trainer holds %s: expect a larger train/inference "
                "mismatch (sampling/importance_sampling_ratio far from 1). Serve with `--dtype %s`.",
                served, trained, trained,
            )


def row_loss(model, row, num_trained_tokens_global: float, args: AsyncGRPOConfig, loss_fn) -> tuple[torch.Tensor, dict]:
    """The loss of one packed row (this process's share of a micro-batch), normalized by the trained
    tokens of the whole micro-batch over all processes, and its metrics."""
    aux_coef = args.router_aux_loss_coef or 0.0
    out = row_logprobs(model, row, temperature=args.temperature, router_aux_loss=aux_coef > 0)
    device = out.logprobs.device
    inputs = LossInputs(
        logprobs=out.logprobs,
        sampler_logprobs=_tensor(row.sampler_logprobs, device),
        advantages=_tensor(row.advantages, device),
        entry_sample=_tensor(row.entry_sample, device),
        entropy=out.entropy,
        top_logprobs=out.top_logprobs,
        sampler_top_logprobs=_tensor(row.top_logprobs, device),
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
        metrics["aux_loss"] = Stat(Reduce.MEAN, out.aux_loss.detach() * row.num_entries, float(row.num_entries))
    return loss, metrics


def _tensor(array: np.ndarray | None, device: torch.device) -> torch.Tensor | None:
    return None if array is None else torch.from_numpy(np.ascontiguousarray(array)).to(device)



# TRL's module exports these next to the trainer: `from asyncgrpo.trainer.async_grpo_trainer import
# AsyncRolloutLoop` works like `from trl.trainer.async_grpo_trainer import AsyncRolloutLoop`.
__all__ = ["AsyncGRPOTrainer", "AsyncRolloutLoop", "Rollout", "RolloutGroup", "TrainingSequence", "TurnRecord"]
