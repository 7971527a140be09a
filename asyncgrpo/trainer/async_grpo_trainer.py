"""AsyncGRPOTrainer: asynchronous GRPO on top of transformers.Trainer.

A rollout worker (spawned process) generates and scores groups against vLLM while this loop trains.
This module holds the loop and the optimizer step (`_train_step`, read top to bottom); a run's set-up
(`RunSetup`), evaluation during training (`TrainerEvaluation`), the generation session, checkpoints,
step metrics and a row's loss have modules of their own (docs/architecture.md, "The trainer's
modules"). Logging, checkpointing and callbacks go through the base Trainer's machinery, so
`report_to`, `save_strategy`, `resume_from_checkpoint` and user callbacks behave as usual.
"""

from __future__ import annotations

import copy
import logging
import math
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
from transformers import PreTrainedModel, Trainer
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.trainer_utils import IntervalStrategy, SaveStrategy, TrainOutput

from asyncgrpo import timeline
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.generation.client import VLLMClient
from asyncgrpo.metrics import Reduce
from asyncgrpo.peft_adapters import check_peft_config
from asyncgrpo.rollout.environments import EnvironmentOwnedData
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.types import Rollout, RolloutGroup, TrainingSequence, TurnRecord
from asyncgrpo.rollout.worker import RolloutWorkerPool
from asyncgrpo.trainer.base_loop_settings import EmptyDeviceCache, input_tokens_seen
from asyncgrpo.trainer.checks import (
    check_agent_inputs,
    check_conversational,
    check_epochs_can_end,
    check_no_injected_protocols,
    check_reward_funcs,
    check_reward_weights,
    check_transformers_version,
)
from asyncgrpo.trainer.compile import layer_compile_options
from asyncgrpo.trainer.completions_table import log_to_trackers, print_completions
from asyncgrpo.trainer.device_clock import DeviceClock
from asyncgrpo.trainer.distributed import local_value
from asyncgrpo.trainer.epoch_callbacks import EpochCallbacks
from asyncgrpo.trainer.eval_schedule import TrainerEvaluation
from asyncgrpo.trainer.evaluator import Evaluator
from asyncgrpo.trainer.fsdp_launch import read_fsdp_launch
from asyncgrpo.trainer.generation_session import GenerationSession
from asyncgrpo.trainer.intake import ServersLostWeights, StepBatch, TrainingComplete
from asyncgrpo.trainer.loss_menu import LossMenu
from asyncgrpo.trainer.nonfinite import MAX_NONFINITE_STEPS, NonFiniteTrainingError
from asyncgrpo.trainer.optimizer_step import queue_clipped_step, takes_device_decisions, with_triton_update
from asyncgrpo.trainer.policy_model import load_policy_model, prepare_policy_model, prepare_tokenizer
from asyncgrpo.trainer.progress import AsyncProgressCallback
from asyncgrpo.trainer.row_loss import QueuedRows, replayed_routing_of, values_on_host
from asyncgrpo.trainer.run_directory import RunDirectoryCallback
from asyncgrpo.trainer.run_setup import RunSetup
from asyncgrpo.trainer.step_metrics import StepResult
from asyncgrpo.trainer.teacher_check import check_teachers

logger = logging.getLogger(__name__)


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


class AsyncGRPOTrainer(RunSetup, TrainerEvaluation, Trainer):
    loop_cls = AsyncRolloutLoop
    # The rollout loop runs an agent whose rollouts carry their own reward (Rollout.reward) and whose
    # prompts carry tools: reward_funcs may be empty, and the tokenizer gets the training template.
    _agent_loop = False
    # The loss's signal needs no reward source (distillation: the teacher's scores).
    _signal_without_rewards = False
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
        *,
        # Last and by name only: the parameters before it keep TRL's positional order.
        eval_dataset=None,
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
        check_reward_weights(list(reward_funcs), args.reward_weights)
        tools = list(tools or [])
        rewards_optional = self._agent_loop or self._signal_without_rewards
        check_agent_inputs(reward_funcs, train_dataset, tools, environment_factory, args, rewards_optional)
        if train_dataset is None:  # the environment owns the data (checked above: max_steps is set)
            train_dataset = EnvironmentOwnedData()
        check_no_injected_protocols(rollout_worker, weight_transfer)
        streaming = not hasattr(train_dataset, "__len__")
        check_epochs_can_end(streaming, args.max_steps)
        check_conversational(train_dataset, environment_factory)
        if peft_config is not None:
            check_peft_config(peft_config)  # before the model loads: a refused config costs no download
        if isinstance(model, str):
            model = self._load_model(model, args)
        model = prepare_policy_model(model, args, peft_config)
        agentic = bool(tools) or environment_factory is not None or self._agent_loop
        # The built-in tool loop (or the agent harness) reads the calls; a loop_cls with its own
        # generate_one may read them itself, and the worker refuses an unreadable format if it does not.
        reads_tool_calls = self._agent_loop or getattr(self.loop_cls, "generate_one", None) is (
            AsyncRolloutLoop.generate_one
        )
        processing_class = prepare_tokenizer(processing_class, model_id, args, agentic, reads_tool_calls)
        check_teachers(processing_class, model_id, args, train_dataset)  # before the model moves anywhere

        # torch_compile means regional compilation of the decoder layers here (trainer/compile.py); the
        # base Trainer would compile the whole model, whose forward this trainer does not call.
        self._compile_layers = layer_compile_options(args)
        if args.torch_compile:
            args.torch_compile, args.torch_compile_backend, args.torch_compile_mode = False, None, None
        self.reward_funcs = list(reward_funcs)
        self.tools = tools
        self.environment_factory = environment_factory
        self.model_id = model_id
        self.streaming = streaming
        # The loss: GRPO's menu (the reference, the entropy coefficient) or a subclass's (`_make_loss`).
        self._loss_menu = self._make_loss(model, args)
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
            eval_dataset=eval_dataset,
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
        # What a run trains with and counts: `_begin_run` creates all of it when train() starts. Until then
        # there is no generation session (the attributes below read None).
        self._session: GenerationSession | None = None
        self._evaluator: Evaluator | None = None  # rank 0, while train() runs and has evaluated
        self._in_run = False  # every rank, while train() runs: an evaluate() call is then collective
        # The eval rows, read (and checked) now: a dataset without a length fails here, not mid-run.
        self._eval_rows = self._eval_datasets(None, "eval") if eval_dataset is not None else None

    # -- TRL's public attributes (rank 0 holds the client, worker and sync; other ranks see None) ---------

    @property
    def vllm_client(self) -> VLLMClient | None:
        """The HTTP client of the vLLM servers (async methods: run them on the trainer's loop)."""
        return self._session.client if self._session is not None else None

    @property
    def model_version(self) -> int:
        """The policy version the servers run: the number of weight syncs since the run began."""
        return self._session.model_version if self._session is not None else 0

    @property
    def rollout_worker(self) -> RolloutWorkerPool | None:
        return self._session.worker if self._session is not None else None

    @property
    def weight_transfer(self):
        """The weight-sync backend (FilesystemWeightSync or NcclWeightSync)."""
        return self._session.weight_sync if self._session is not None else None

    @staticmethod
    def _load_model(model_id: str, args: AsyncGRPOConfig) -> PreTrainedModel:
        return load_policy_model(model_id, args)

    def _make_loss(self, model: PreTrainedModel, args: AsyncGRPOConfig) -> LossMenu:
        """The rows' loss and its state across steps: GRPO's loss menu (a subclass swaps it)."""
        return LossMenu(model, args)

    # -- transformers.Trainer overrides. Private ones: `_inner_training_loop` and `_save_checkpoint` (and
    # `_tag_names` above); the others, and the base methods they call, are listed in docs/architecture.md
    # ("The trainer's modules").

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, **kwargs):
        """`Trainer.train`, with SIGTERM (`kill`, a scheduler's timeout) unwinding like Ctrl-C: the
        rollout worker is stopped, the server resumed and the weight files removed either way. The
        run holds its output_dir throughout: another live run there is refused before anything is
        read or written (`resume_from_checkpoint=True` included)."""
        with _sigterm_raises_keyboard_interrupt(), self._holding_run_directory():
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)

    def _inner_training_loop(
        self, batch_size=None, args=None, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None
    ) -> TrainOutput:
        args = args or self.args
        model = self._begin_run(args, resume_from_checkpoint, trial)
        started, first_step = time.time(), self.state.global_step
        try:
            with timeline.span("open generation session"):
                self._session.open(self, self._ledger, stop_condition=lambda: self._should_stop(args))
            self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
            # The servers run exactly the weights training starts from.
            self._session.sync_weights(self.accelerator.unwrap_model(model))
            self._served_step = self.state.global_step
            with timeline.span("wait for rollout worker"):
                self._session.start_rollouts(ready_timeout=args.vllm_server_timeout + 300)
            self._open_evaluator()
            if args.eval_on_start:  # as the base Trainer: at the start of every train() call
                self._start_eval(trial)
            epochs = EpochCallbacks(self.callback_handler)
            while not self._processes.broadcast(self._should_stop(args) if self._processes.is_main else None):
                try:
                    self._train_step(model, trial, epochs)
                except TrainingComplete:  # the last prompts consumed while the step waited, or saturation
                    # They count: the epoch training ends in is whole (2.0 of 2 epochs, not the last
                    # step's 1.875), as on_epoch_end and the run's last log see it.
                    self._count_consumed_prompts()
                    break
                if self.control.should_training_stop:
                    break
            ended_before_max_steps = not self.control.should_training_stop
            self.control.should_log = self.control.should_save = False  # the last step's are done
            self.control = epochs.finish(args, self.state, self.control)
            if ended_before_max_steps:
                self._end_as_at_max_steps(args)
            self._log_and_save(model, trial)  # what on_epoch_end asked for (epoch strategies)
            self._join_eval(trial)
            self._checkpoints.finish(self, model, trial, self._resume_point)  # on the disk, before it is read
            self._end_with_served_weights(trial)
        finally:
            try:
                self._checkpoints.close()  # after a failure too: the save in flight still lands
                self._close_evaluator()
            finally:
                self._session.close()
                self._close_timeline()
        runtime = time.time() - started
        steps = self.state.global_step - first_step
        train_loss = self._metrics.train_loss_sum / max(steps, 1)
        metrics = {
            "train_runtime": runtime,
            "train_steps_per_second": steps / max(runtime, 1e-9),
            "train_loss": train_loss,
        }
        self._memory_tracker.stop_and_update_metrics(metrics)  # skip_memory_metrics=False: as the base loop
        self.log(metrics)
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        return TrainOutput(self.state.global_step, train_loss, metrics)

    def _save_checkpoint(self, model, trial) -> None:
        """Written whole or not at all, by every rank together (trainer/checkpoint_saves.py)."""
        self._checkpoints.save(self, model, trial, self._resume_point())

    @staticmethod
    def get_optimizer_cls_and_kwargs(args, model=None):
        """Trainer's choice from `optim`, with torch's fused AdamW run as the Triton AdamW on CUDA
        (`triton_adamw`, trainer/optimizer_step.py)."""
        optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        return with_triton_update(optimizer_cls, kwargs, args), kwargs

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True):
        """bf16/fp16 autocast around the loss. The base Trainer relies on accelerate wrapping
        `model.forward` for it, but this trainer calls the decoder and the head directly: without
        this, `bf16=True` trained fp32 weights with fp32 matmuls."""
        return self.accelerator.autocast()

    # -- how far a run is (its set-up: RunSetup, trainer/run_setup.py) -------------------------------------

    def _end_as_at_max_steps(self, args: AsyncGRPOConfig) -> None:
        """Training ended before `max_steps` (the epochs' prompts consumed, or a pass without signal
        after training: docs/reliability.md): ask for the checkpoint and evaluation the base Trainer's
        schedule gives the step at `max_steps`, where this step had none."""
        step = self.state.global_step
        if step == 0:
            return
        if args.save_strategy == SaveStrategy.STEPS and step % self.state.save_steps != 0:
            self.control.should_save = True
        if (
            args.eval_strategy == IntervalStrategy.STEPS
            and step % self.state.eval_steps != 0
            and args.eval_delay <= step
        ):
            self.control.should_evaluate = True

    def _should_stop(self, args: AsyncGRPOConfig) -> bool:
        if args.max_steps > 0:
            return self.state.global_step >= args.max_steps
        return self._ledger.epoch_prompts >= math.ceil(args.num_train_epochs * len(self.train_dataset))

    def _epoch(self) -> float:
        if self.streaming:
            return float(self.state.global_step) / max(self.args.max_steps, 1)
        return self._ledger.epoch_prompts / len(self.train_dataset)

    # -- one optimizer step ---------------------------------------------------------------------------

    def _train_step(self, model, trial, epochs: EpochCallbacks) -> None:
        """One optimizer step, top to bottom. Raises TrainingComplete when the last prompts were
        consumed while it waited for samples."""
        args = self.args
        self.control = epochs.before_step(args, self.state, self.control)
        self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
        if self._timeline is not None:
            self._timeline.begin_step(self.state.global_step + 1)
        with timeline.span(timeline.STEP_FRAME):
            started = time.perf_counter()
            with timeline.span("take samples"):
                batch = self._wait_for_samples(
                    model
                )  # planned into rows, one per process in each micro-batch
            queued = self._forward_backward(model, batch)
            result = self._optimizer_step(model, queued)
            self._loss_menu.after_step(
                self._metrics.window, self.accelerator.unwrap_model(model), self.state.global_step + 1
            )
            self._sync_weights_if_due(model, result)
            self._record_metrics(batch, result, time.perf_counter() - started)
            self._end_step(epochs)
            self._log_and_save(model, trial)  # the window's metrics and a checkpoint, as the schedule says
        if self._timeline is not None:
            self._timeline.write_if_due()

    def _wait_for_samples(self, model) -> StepBatch:
        """The step's samples, planned into rows: rank 0 takes them from the rollout worker and every
        rank gets the plan. Servers that lost the policy get it again first."""
        accumulation = self.args.gradient_accumulation_steps
        on_main = self._processes.is_main
        batch = self._processes.broadcast(self._session.next_batch(accumulation) if on_main else None)
        while isinstance(batch, ServersLostWeights):
            self._join_eval(None)  # it may have run on a lost server: it is discarded, not logged
            if self._served_step != self.state.global_step:
                # Every server gets the model as it is now: a new version (weight_sync_steps > 1).
                self._session.model_version += 1
                self._served_step = self.state.global_step
            self._session.restore_server_weights(self.accelerator.unwrap_model(model), batch)
            batch = self._processes.broadcast(self._session.next_batch(accumulation) if on_main else None)
        if batch is None:
            raise TrainingComplete()
        return batch

    def _forward_backward(self, model, batch: StepBatch) -> QueuedRows:
        """Tree-packed forward and backward of every micro-batch, queued: nothing here waits for the
        GPU (timings are device events, losses and metrics are read by `_read_rows`), so the host
        packs and uploads the next row while the GPU runs the previous one."""
        args, window = self.args, self._metrics.window
        clock = DeviceClock(args.device)
        world, rank = self._processes.world_size, self._processes.rank
        row_marks, row_losses, row_stats = [], [], []
        step = self._loss_menu.step_loss(batch)
        for index, plan in enumerate(batch.plans):
            if index:  # the base Trainer's point: after each micro-batch but the step's last
                self.control = self.callback_handler.on_substep_end(args, self.state, self.control)
            with timeline.span("pack", rows=len(plan.rows)):
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
                window.record("perf/checkpointed_layers", memory_plan.checkpointed_layers)
                window.record("perf/head_logits_kept", float(memory_plan.keep_logits))
                keep_logits = memory_plan.keep_logits
            started = clock.mark()
            with replayed_routing_of(model, row):
                with self.compute_loss_context_manager(), timeline.span("forward", tokens=row.num_tokens):
                    row_step = self._loss_menu.for_row(step, counted=weight > 0)
                    loss, stats = self._loss_menu.row_loss(
                        model, row, entries_global, row_step, keep_logits, batch.model_version
                    )
                forward_done = clock.mark()
                # FSDP2 averages gradients over processes; the loss is already normalized globally.
                with timeline.span("backward", tokens=row.num_tokens):
                    self.accelerator.backward(loss * (world * weight))
            row_marks.append((started, forward_done, clock.mark()))
            if weight:
                row_losses.append(loss.detach())
                row_stats.append(stats)
        return QueuedRows(clock, row_marks, row_losses, row_stats)

    def _read_rows(self, queued: QueuedRows) -> StepResult:
        """The step's loss and forward/backward times (its optimizer part still to fill in); the
        rows' metrics go to the window. Waits for the device, once."""
        clock = queued.clock
        fwd_s = sum(clock.seconds(started, forward_done) for started, forward_done, _ in queued.marks)
        fwd_bwd_s = sum(clock.seconds(started, done) for started, _, done in queued.marks)
        with timeline.span("read rows"):  # on a GPU: where the host waits for the device
            loss_total, row_stats = values_on_host(queued.losses, queued.stats)
        gathered = self._processes.gather((loss_total, row_stats))
        for _, stats_of_rank in gathered:
            for stats in stats_of_rank:
                self._metrics.window.merge(stats)
        self._loss_menu.observe([stats for _, stats_of_rank in gathered for stats in stats_of_rank])
        return StepResult(loss=sum(rank_loss for rank_loss, _ in gathered), fwd_s=fwd_s, fwd_bwd_s=fwd_bwd_s)

    def _optimizer_step(self, model, queued: QueuedRows) -> StepResult:
        """Clip and step, skipping the step when the loss or the gradient norm is not finite: one bad
        batch must not turn the weights, and then the server's, into NaN. On one process with a
        fused optimizer the device decides (`_device_decided_step`), otherwise the host does; both
        end the same way."""
        self._checkpoints.before_optimizer_step()  # a background save's copy is taken before the update
        with timeline.span("optimizer"):
            if self._sharded or self._processes.distributed or not takes_device_decisions(self.optimizer):
                result = self._host_decided_step(model, queued)
            else:
                result = self._device_decided_step(model, queued)
        window = self._metrics.window
        window.record("train/nonfinite_steps", 0 if result.stepped else 1, Reduce.SUM)
        if result.stepped:
            window.record("grad_norm", result.grad_norm)
            self.control = self.callback_handler.on_optimizer_step(self.args, self.state, self.control)
            self.lr_scheduler.step()
            self._nonfinite_streak = 0
        else:
            self._count_nonfinite_step(result)
        model.zero_grad(set_to_none=True)
        return result

    def _host_decided_step(self, model, queued: QueuedRows) -> StepResult:
        """Read the rows, then clip and step deciding on the host (several processes, or an optimizer
        that cannot decide on the device)."""
        result = self._read_rows(queued)
        started = self._now()
        result.grad_norm = local_value(
            self.accelerator.clip_grad_norm_(model.parameters(), self._max_grad_norm())
        )  # inf: measure only
        # Both are global: every rank agrees.
        result.stepped = math.isfinite(result.loss) and math.isfinite(result.grad_norm)
        if result.stepped:
            self.control = self.callback_handler.on_pre_optimizer_step(self.args, self.state, self.control)
            self.optimizer.step()
        result.optimizer_s = self._now() - started
        return result

    def _device_decided_step(self, model, queued: QueuedRows) -> StepResult:
        """Clipping and the finiteness check queued on the device behind the last backward
        (trainer/optimizer_step.py); the host reads the step's values once, at the end."""
        clock = queued.clock
        started = clock.mark()
        loss = torch.stack(queued.losses).sum() if queued.losses else torch.zeros(())
        self.control = self.callback_handler.on_pre_optimizer_step(self.args, self.state, self.control)
        grad_norm, skipped = queue_clipped_step(
            self.optimizer, list(model.parameters()), self._max_grad_norm(), loss
        )
        done = clock.mark()
        result = self._read_rows(queued)
        result.grad_norm, result.stepped = float(grad_norm), not bool(skipped)
        result.optimizer_s = clock.seconds(started, done)
        return result

    def _count_nonfinite_step(self, result: StepResult) -> None:
        """A skipped step: warned about; `MAX_NONFINITE_STEPS` in a row stop the run."""
        self._nonfinite_streak += 1
        logger.warning(
            "step %d: non-finite loss (%s) or gradient norm (%s): the optimizer step and the weight "
            "sync are skipped (%d in a row)",
            self.state.global_step + 1,
            result.loss,
            result.grad_norm,
            self._nonfinite_streak,
        )
        if self._nonfinite_streak >= MAX_NONFINITE_STEPS:
            raise NonFiniteTrainingError(
                f"{self._nonfinite_streak} steps in a row had a non-finite loss or gradient norm (last: "
                f"loss {result.loss}, gradient norm {result.grad_norm}); training stopped before the weights "
                "were touched. Lower learning_rate, set max_grad_norm, and look at the rewards and "
                "advantages of recent steps."
            )

    def _sync_weights_if_due(self, model, result: StepResult) -> None:
        """Every `weight_sync_steps` steps that changed the weights: a new policy version, pushed."""
        if result.stepped and (self.state.global_step + 1) % self.args.weight_sync_steps == 0:
            self._join_eval(None)  # an evaluation measures one policy: the sync waits for it
            self._push_weights(self.state.global_step + 1)

    def _push_weights(self, step: int) -> None:
        """A new policy version, pushed to the servers: the weights of global step `step`."""
        self._session.model_version += 1
        self._session.sync_weights(self.accelerator.unwrap_model(self.model_wrapped))
        self._served_step = step

    def _record_metrics(self, batch: StepBatch, result: StepResult, step_s: float) -> None:
        learning_rate = self.lr_scheduler.get_last_lr()[0]
        forwarded, padded = self._metrics.record_step(batch, result, step_s, learning_rate)
        # include_num_input_tokens_seen: the base Trainer's log() reports this count.
        self.state.num_input_tokens_seen += input_tokens_seen(self.args, forwarded, padded)
        self._session.collect_worker_metrics()

    def _count_consumed_prompts(self) -> None:
        """The state's epoch and the progress bar, from the steps taken and the prompts consumed."""
        self.state.epoch = self._processes.broadcast(self._epoch() if self._processes.is_main else None)
        self._progress.advance_to(
            self.state.global_step if self.args.max_steps > 0 else self._ledger.epoch_prompts
        )

    def _end_step(self, epochs: EpochCallbacks) -> None:
        """The step counted (global step, epoch, progress), then the step-end callbacks."""
        args = self.args
        self.state.global_step += 1
        self._count_consumed_prompts()
        self.control = self.callback_handler.on_step_end(args, self.state, self.control)
        self.control = epochs.after_step(args, self.state, self.control)

    def _log_and_save(self, model, trial) -> None:
        self._checkpoints.check(self.control)  # a save in flight settled; a failed one due again
        if self.control.should_log:
            with timeline.span("log"):
                logs = self._metrics.flush()
                if self._session.mismatch_watch is not None:  # rank 0
                    self._session.mismatch_watch.check(logs, self.state.global_step)
                self.log(logs)
                if self.args.log_completions:
                    self._log_completions()
        if self.control.should_evaluate:
            self._start_eval(trial)
            if self.control.should_save or self.args.save_strategy == SaveStrategy.BEST:
                self._join_eval(trial)  # the checkpoint's "best" needs this step's figures
        if self.control.should_save:
            with timeline.span("checkpoint"):
                self._save_checkpoint(model, trial)
                self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _log_completions(self) -> None:
        """`log_completions`: the recent completions printed, and sent as a table to the trackers of
        `report_to` that show tables (W&B, trackio), on the main process."""
        step = self.state.global_step
        rows = self._metrics.take_completions(self.processing_class, step, self.args.num_completions_to_print)
        if rows and self.state.is_world_process_zero:
            print_completions(rows, step)
            log_to_trackers(rows, self.args.report_to)

    # -- helpers --------------------------------------------------------------------------------------------

    def _now(self) -> float:
        if torch.cuda.is_available() and self.args.device.type == "cuda":
            torch.cuda.synchronize(self.args.device)
        return time.perf_counter()

    def _max_grad_norm(self) -> float:
        max_norm = self.args.max_grad_norm
        return max_norm if max_norm and max_norm > 0 else math.inf


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
