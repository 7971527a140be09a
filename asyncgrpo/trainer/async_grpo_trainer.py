"""AsyncGRPOTrainer: asynchronous GRPO on top of transformers.Trainer.

A rollout worker (spawned process) generates and scores groups against vLLM while this loop trains.
Here: the TRL surface, the transformers overrides and the step (`_train_step`, read top to bottom).
A train() call's state and parts are its per-run object (`TrainingRun`, trainer/training_run.py;
docs/architecture.md, "The trainer's modules"). Logging, checkpointing and callbacks go through the
base Trainer's machinery, so `report_to`, `save_strategy`, `resume_from_checkpoint` and user
callbacks behave as usual.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from pathlib import Path
from typing import Callable

import torch
from transformers import PreTrainedModel, Trainer
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.trainer_utils import SaveStrategy, TrainOutput

from asyncgrpo.checkpoints.layout import is_sharded
from asyncgrpo.checkpoints.live_model import is_sharded_module
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.generation.client import VLLMClient
from asyncgrpo.records.metrics import Reduce
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.prompts import PromptOrder
from asyncgrpo.rollout.types import Rollout, RolloutGroup, TrainingSequence, TurnRecord
from asyncgrpo.rollout.worker import RolloutWorkerPool
from asyncgrpo.run import timeline
from asyncgrpo.run.lock import OwnerLock
from asyncgrpo.trainer.base_loop_settings import EmptyDeviceCache, input_tokens_seen
from asyncgrpo.trainer.checkpoint import (
    ResumePoint,
    load_sharded_weights,
    save_sharded_model,
    start_trainer_state,
)
from asyncgrpo.trainer.checks import (
    check_launch,
    check_multi_process,
    check_no_injected_protocols,
    check_trainer_inputs,
    check_transformers_version,
)
from asyncgrpo.trainer.compile import take_compile_options
from asyncgrpo.trainer.completions_table import log_to_trackers, print_completions
from asyncgrpo.trainer.distributed import Processes, local_value
from asyncgrpo.trainer.epoch_callbacks import EpochCallbacks, ask_as_at_max_steps
from asyncgrpo.trainer.eval_schedule import evaluate_outside_run, named_eval_datasets
from asyncgrpo.trainer.fsdp_launch import read_fsdp_launch
from asyncgrpo.trainer.generation_session import SessionInputs
from asyncgrpo.trainer.intake import ServersLostWeights, StepBatch, StepOutcome, TrainingComplete
from asyncgrpo.trainer.loss_menu import LossMenu
from asyncgrpo.trainer.optimizer_step import (
    device_decided_step,
    host_decided_step,
    max_grad_norm,
    takes_device_decisions,
    with_triton_update,
)
from asyncgrpo.trainer.policy_model import load_policy_model, prepare_policy_model, prepare_tokenizer
from asyncgrpo.trainer.progress import AsyncProgressCallback
from asyncgrpo.trainer.rollout_inputs import RolloutInputs, eos_token_ids
from asyncgrpo.trainer.row_loss import QueuedRows
from asyncgrpo.trainer.run_directory import RunDirectoryCallback
from asyncgrpo.trainer.run_setup import (
    EvaluationHooks,
    begin_run,
    holding_run_directory,
    prepare_model,
    sigterm_raises_keyboard_interrupt,
)
from asyncgrpo.trainer.step_metrics import StepResult
from asyncgrpo.trainer.teacher_check import check_teachers
from asyncgrpo.trainer.training_run import TrainingRun

logger = logging.getLogger(__name__)


class AsyncGRPOTrainer(Trainer):
    # -- what a second trainer on this pipeline supplies (docs/architecture.md, "A second trainer") --------
    loop_cls = AsyncRolloutLoop  # the rollout loop class: a user's subclass, or a harness's loop
    # The rollout loop runs an agent whose rollouts carry their own reward (Rollout.reward) and whose
    # prompts carry tools: reward_funcs may be empty, and the tokenizer gets the training template.
    _agent_loop = False
    # The loss's signal needs no reward source (distillation: the teacher's scores).
    _signal_without_rewards = False
    _tag_names = ["trl", "async-grpo", "asyncgrpo"]
    config_class = AsyncGRPOConfig  # what `args` must be; its name, less "Config", ends output_dir's default

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
        args = self._own_args(args, model_id)
        # Before the model loads: a refused argument costs no download.
        check_no_injected_protocols(rollout_worker, weight_transfer)
        rewards_optional = self._agent_loop or self._signal_without_rewards
        inputs = check_trainer_inputs(
            reward_funcs, args, train_dataset, tools, environment_factory, peft_config, rewards_optional
        )
        if isinstance(model, str):
            model = self._load_model(model, args)
        model = prepare_policy_model(model, args, peft_config)
        agentic = bool(inputs.tools) or environment_factory is not None or self._agent_loop
        reads_tool_calls = self._reads_tool_calls()
        processing_class = prepare_tokenizer(processing_class, model_id, args, agentic, reads_tool_calls)
        # Eval rows read, every row's teacher checked, before the model moves: bad rows fail now, not mid-run.
        eval_rows = named_eval_datasets(eval_dataset, "eval") if eval_dataset is not None else None
        check_teachers(processing_class, model_id, args, inputs.train_dataset, eval_rows)
        self._compile_layers = take_compile_options(args)
        self.reward_funcs, self.tools, self.streaming = inputs.reward_funcs, inputs.tools, inputs.streaming
        self.environment_factory, self.model_id = environment_factory, model_id
        # The loss: GRPO's menu (the reference, the entropy coefficient) or a subclass's (`_make_loss`).
        self._loss_menu = self._make_loss(model, args)
        self._progress = AsyncProgressCallback.for_run(args, inputs.train_dataset)
        super().__init__(
            model=model,
            args=args,
            train_dataset=inputs.train_dataset,
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
        self._run_lock: OwnerLock | None = None  # rank 0's hold on output_dir while train() runs
        # What a run trains with and counts: `_begin_run` creates it when train() starts. Until then
        # there is no generation session (the TRL attributes below read None).
        self._run: TrainingRun | None = None
        self._eval_rows = eval_rows

    @classmethod
    def _own_args(cls, args, model_id: str):
        """The run's own copy of `args` (the default config when None): the trainer resolves settings
        against the model (router_aux_loss_coef, torch_compile) on it, so the caller's stay as given
        and can build a second trainer."""
        if args is None:
            suffix = cls.config_class.__name__.removesuffix("Config")
            return cls.config_class(output_dir=f"{Path(model_id).name or 'model'}-{suffix}")
        if not isinstance(args, cls.config_class):
            raise TypeError(
                f"{cls.__name__} needs an {cls.config_class.__name__} as args (its settings), got "
                f"{type(args).__name__}"
            )
        return copy.copy(args)

    # -- TRL's public attributes (rank 0 holds the client, worker and sync; other ranks see None) ---------

    @property
    def vllm_client(self) -> VLLMClient | None:
        """The HTTP client of the vLLM servers (async methods: run them on the trainer's loop)."""
        return self._run.session.client if self._run is not None else None

    @property
    def model_version(self) -> int:
        """The policy version the servers run: the number of weight syncs since the run began."""
        return self._run.session.model_version if self._run is not None else 0

    @property
    def rollout_worker(self) -> RolloutWorkerPool | None:
        return self._run.session.worker if self._run is not None else None

    @property
    def weight_transfer(self):
        """The weight-sync backend (FilesystemWeightSync or NcclWeightSync)."""
        return self._run.session.weight_sync if self._run is not None else None

    @staticmethod
    def _load_model(model_id: str, args: AsyncGRPOConfig) -> PreTrainedModel:
        return load_policy_model(model_id, args)

    def _make_loss(self, model: PreTrainedModel, args: AsyncGRPOConfig) -> LossMenu:
        """The rows' loss and its state across steps: GRPO's loss menu (a subclass swaps it)."""
        return LossMenu(model, args)

    def _reads_tool_calls(self) -> bool:
        """The built-in tool loop (or the agent harness) reads the calls; a loop_cls with its own
        generate_one may read them itself, and the worker refuses an unreadable format if it does not."""
        built_in = getattr(self.loop_cls, "generate_one", None) is AsyncRolloutLoop.generate_one
        return self._agent_loop or built_in

    def _rollout_inputs(self) -> RolloutInputs:
        """What the rollout loops (training's workers, the evaluator) are built from."""
        eos, tools = eos_token_ids(self.model, self.processing_class), self.tools
        return RolloutInputs(
            self.loop_cls, self.reward_funcs, self.processing_class, eos, tools, self.environment_factory
        )

    # -- transformers.Trainer overrides. Private ones: `_inner_training_loop`, `_save_checkpoint`,
    # `_load_from_checkpoint` and `_load_best_model` (and `_tag_names` above); the others, and the base
    # methods they call, are listed in docs/architecture.md ("The trainer's modules").

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, **kwargs):
        """`Trainer.train`, with SIGTERM (`kill`, a scheduler's timeout) unwinding like Ctrl-C: the
        rollout worker is stopped, the server resumed and the weight files removed either way. The
        run holds its output_dir throughout: another live run there is refused before anything is
        read or written (`resume_from_checkpoint=True` included)."""
        processes = Processes(self.accelerator.num_processes, self.accelerator.process_index)
        with (
            sigterm_raises_keyboard_interrupt(),
            holding_run_directory(processes, self.args.output_dir) as lock,
        ):
            self._run_lock = lock
            try:
                return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
            finally:
                self._run_lock = None

    def _inner_training_loop(
        self, batch_size=None, args=None, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None
    ) -> TrainOutput:
        args = args or self.args
        model = self._begin_run(args, resume_from_checkpoint, trial)
        run = self._run
        started, first_step = time.time(), self.state.global_step
        try:
            with timeline.span("open generation session"):
                inputs = SessionInputs(
                    args, self.model, self._rollout_inputs(), self.train_dataset, self.streaming
                )
                run.session.open(inputs, run.ledger, stop_condition=lambda: self._should_stop(args))
            self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
            run.serve_starting_weights(self.accelerator.unwrap_model(model), self.state.global_step)
            with timeline.span("wait for rollout worker"):
                run.session.start_rollouts(ready_timeout=args.vllm_server_timeout + 300)
            run.evaluations.open()
            if args.eval_on_start:  # as the base Trainer: at the start of every train() call
                self._start_eval(trial)
            epochs = EpochCallbacks(self.callback_handler)
            while not run.processes.broadcast(self._should_stop(args) if run.processes.is_main else None):
                if isinstance(self._train_step(model, trial, epochs), TrainingComplete):
                    # The last prompts consumed while the step waited, or saturation. They count: the
                    # epoch training ends in is whole (2.0 of 2 epochs, not the last step's 1.875), as
                    # on_epoch_end and the run's last log see it.
                    self._count_consumed_prompts()
                    break
                if self.control.should_training_stop:
                    break
            self._finish(model, trial, epochs, ended_before_max_steps=not self.control.should_training_stop)
        finally:
            run.close()
        runtime, steps = time.time() - started, self.state.global_step - first_step
        train_loss = run.metrics.train_loss_sum / max(steps, 1)
        metrics = {
            "train_runtime": runtime,
            "train_steps_per_second": steps / max(runtime, 1e-9),
            "train_loss": train_loss,
        }
        self._memory_tracker.stop_and_update_metrics(metrics)  # skip_memory_metrics=False: as the base loop
        self.log(metrics)
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        return TrainOutput(self.state.global_step, train_loss, metrics)

    def _finish(self, model, trial, epochs: EpochCallbacks, ended_before_max_steps: bool) -> None:
        """The end of training: the last epoch closed, what the schedule gives the last step (as at
        max_steps when training ended before it), the evaluation joined, the final checkpoint on the
        disk, and the servers left with the weights the run ends with."""
        args = self.args
        self.control.should_log = self.control.should_save = False  # the last step's are done
        self.control = epochs.finish(args, self.state, self.control)
        if ended_before_max_steps:
            ask_as_at_max_steps(args, self.state, self.control)
        self._log_and_save(model, trial)  # what on_epoch_end asked for (epoch strategies)
        self._run.evaluations.join(trial)
        self._run.checkpoints.finish(self, model, trial, self._resume_point)  # on the disk, before it is read
        self._end_with_served_weights()

    def _begin_run(self, args: AsyncGRPOConfig, checkpoint: str | None, trial) -> torch.nn.Module:
        """The run's per-run object (`_run`), after the trainer state (fresh or the checkpoint's), the
        model to train and its optimizer. Returns the model to train."""
        check_launch(self.accelerator.num_processes, args.use_cpu)
        processes = Processes(self.accelerator.num_processes, self.accelerator.process_index)
        sharded = processes.distributed or self._fsdp_launch is not None
        if processes.distributed:
            check_multi_process(self.is_deepspeed_enabled, self.optimizer is not None)
        self.accelerator.free_memory()
        resume = start_trainer_state(self, args, checkpoint, self.streaming)
        model = prepare_model(self, checkpoint, processes, sharded, self._fsdp_launch, self._compile_layers)
        reshard = self._fsdp_launch.reshard_after_forward if self._fsdp_launch is not None else True
        self._loss_menu.prepare(processes, sharded, reshard, self._compile_layers, resume.algorithm)
        self.state.init_training_references(self, self.state.max_steps, args.num_train_epochs, trial)
        evaluation = EvaluationHooks(self._eval_rows, self._report_eval, self._catch_up_server_weights)
        policy, rollout = self.accelerator.unwrap_model(model), self._rollout_inputs()
        training = (policy, self.optimizer, self._loss_menu)
        self._run = begin_run(
            args, processes, sharded, resume, *training, rollout, evaluation, self._run_lock
        )
        return model

    def _resume_point(self) -> ResumePoint:
        """What a checkpoint of this run carries beyond the weights and the optimizer."""
        return self._run.resume_point(PromptOrder.of(self.args), self._loss_menu.state())

    def _save_checkpoint(self, model, trial) -> None:
        """Written whole or not at all, by every rank together (trainer/checkpoint_saves.py)."""
        self._run.checkpoints.save(self, model, trial, self._resume_point())

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Overrides Trainer's (called by `Trainer.train`): a full checkpoint's weights, as the base
        Trainer loads them; a sharded one's are read into the shards by `prepare_model` (run_setup.py)."""
        if not is_sharded(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model`; a model sharded over several processes (every rank calls it): streamed,
        consolidated (trainer/checkpoint.py, `save_sharded_model`)."""
        if _internal_call or not is_sharded_module(self.model):
            super().save_model(output_dir, _internal_call)
        else:
            save_sharded_model(self, output_dir or self.args.output_dir)

    def _load_best_model(self) -> None:
        """Overrides Trainer's (load_best_model_at_end): the best checkpoint's weights, read from its
        shards when it is sharded (every rank)."""
        if is_sharded(self.state.best_model_checkpoint):
            processes = Processes(self.accelerator.num_processes, self.accelerator.process_index)
            load_sharded_weights(self, self.state.best_model_checkpoint, processes)
        else:
            super()._load_best_model()

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

    # -- evaluation: the loop's side (the run's EvaluationSchedule, trainer/eval_schedule.py) ----------

    def evaluate(
        self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Held-out figures of the policy the servers run (`Trainer.evaluate`'s arguments; a dict of
        datasets prefixes each name, `eval_{name}_reward`). During train() the servers are first given
        the current weights; outside it they are sampled as they are: before train() they run the
        checkpoint they were started with, after it the final weights (train() ends with them pushed
        when the run has an eval dataset). `ignore_keys` has no meaning here (no model outputs)."""
        datasets = named_eval_datasets(eval_dataset, metric_key_prefix, self.eval_dataset)
        run, step = self._run, self.state.global_step
        if run is not None and run.evaluations.opened:
            return run.evaluations.evaluate_now(datasets, step)
        served = run.served_step if run is not None else None
        joined = evaluate_outside_run(
            self.args, self._rollout_inputs(), datasets, step, self.model_version, served
        )
        return self._report_eval(*joined, None) if joined else {}

    def _start_eval(self, trial) -> None:
        self.control.should_evaluate = False
        self._run.evaluations.start(self.state.global_step, trial)

    def _report_eval(self, step: int, figures: dict[str, float], trial) -> dict[str, float]:
        """Log `figures` at `step` (the base Trainer's log and on_evaluate), and track the best one
        (`metric_for_best_model`); a new best at the current step asks for its checkpoint when
        save_strategy is "best"."""
        current = self.state.global_step
        # The figures may be joined a step or more after the one they measure: log_history, metrics.jsonl
        # and report_to take the step from the state, so it reads the measured step while they log.
        self.state.global_step = step
        try:
            self.log(dict(figures))
            new_best = self._determine_best_metric(metrics=figures, trial=trial)
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, figures)
        finally:
            self.state.global_step = current
        if new_best and step == current and self.args.save_strategy == SaveStrategy.BEST:
            self.control.should_save = True
        return figures

    def _catch_up_server_weights(self) -> None:
        """The servers get the current weights if the last sync left them behind (training_run.py)."""
        policy = self.accelerator.unwrap_model(self.model_wrapped)
        self._run.catch_up_server_weights(policy, self.state.global_step)

    def _end_with_served_weights(self) -> None:
        """With an eval dataset, train() leaves the servers running the weights it ends with (the best
        checkpoint's with load_best_model_at_end), so an evaluate() after it measures them."""
        if self._eval_rows is None:
            return
        if self.args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            self._load_best_model()
            self._push_weights(self.state.best_global_step)
        else:
            self._catch_up_server_weights()

    # -- how far a run is --------------------------------------------------------------------------------

    def _should_stop(self, args: AsyncGRPOConfig) -> bool:
        if args.max_steps > 0:
            return self.state.global_step >= args.max_steps
        return self._run.ledger.epoch_prompts >= math.ceil(args.num_train_epochs * len(self.train_dataset))

    def _epoch(self) -> float:
        if self.streaming:
            return float(self.state.global_step) / max(self.args.max_steps, 1)
        return self._run.ledger.epoch_prompts / len(self.train_dataset)

    # -- one optimizer step ---------------------------------------------------------------------------

    def _train_step(self, model, trial, epochs: EpochCallbacks) -> TrainingComplete | None:
        """One optimizer step, top to bottom; TrainingComplete (and no step) when the last prompts
        were consumed while it waited for samples."""
        args, run = self.args, self._run
        self.control = epochs.before_step(args, self.state, self.control)
        self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
        if run.timeline is not None:
            run.timeline.recorder.begin_step(self.state.global_step + 1)
        with timeline.span(timeline.STEP_FRAME):
            started = time.perf_counter()
            with timeline.span("take samples"):
                batch = self._wait_for_samples(
                    model
                )  # planned into rows, one per process in each micro-batch
            if isinstance(batch, TrainingComplete):
                return batch
            queued = self._forward_backward(model, batch)
            result = self._optimizer_step(model, queued)
            self._loss_menu.after_step(
                self._run.metrics.window, self.accelerator.unwrap_model(model), self.state.global_step + 1
            )
            self._sync_weights_if_due(model, result)
            self._record_metrics(batch, result, time.perf_counter() - started)
            self._end_step(epochs)
            self._log_and_save(model, trial)  # the window's metrics and a checkpoint, as the schedule says
        if run.timeline is not None:
            run.timeline.recorder.write_if_due()
        return None

    def _wait_for_samples(self, model) -> StepBatch | TrainingComplete:
        """The step's samples, planned into rows: rank 0 takes them from the rollout worker and every
        rank gets the plan (or learns that training is complete). Servers that lost the policy get it
        again first."""
        run, accumulation = self._run, self.args.gradient_accumulation_steps

        def take() -> StepOutcome:
            return run.processes.broadcast(
                run.session.next_batch(accumulation) if run.processes.is_main else None
            )

        outcome = take()
        while isinstance(outcome, ServersLostWeights):
            run.evaluations.join(None)  # it may have run on a lost server: it is discarded, not logged
            run.restore_server_weights(self.accelerator.unwrap_model(model), outcome, self.state.global_step)
            outcome = take()
        return outcome

    def _forward_backward(self, model, batch: StepBatch) -> QueuedRows:
        """Tree-packed forward and backward of every micro-batch, queued (trainer/rows_pass.py)."""
        return self._run.rows.forward_backward(
            model, batch, self.accelerator.backward, self.compute_loss_context_manager, self._substep_end
        )

    def _substep_end(self) -> None:
        self.control = self.callback_handler.on_substep_end(self.args, self.state, self.control)

    def _optimizer_step(self, model, queued: QueuedRows) -> StepResult:
        """Clip and step, skipping the step when the loss or the gradient norm is not finite: one bad
        batch must not turn the weights, and then the server's, into NaN. On one process with a
        fused optimizer the device decides, otherwise the host does (trainer/optimizer_step.py); both
        end the same way."""
        args, run = self.args, self._run
        max_norm = max_grad_norm(args.max_grad_norm)
        run.checkpoints.before_optimizer_step()  # a background save's copy is taken before the update
        with timeline.span("optimizer"):
            if run.sharded or run.processes.distributed or not takes_device_decisions(self.optimizer):

                def clip(norm: float) -> float:  # inf: measure only
                    return local_value(self.accelerator.clip_grad_norm_(model.parameters(), norm))

                read = run.rows.read(queued)
                result = host_decided_step(
                    self.optimizer, clip, max_norm, read, self._before_optimizer_step, args.device
                )
            else:
                parameters = list(model.parameters())
                result = device_decided_step(
                    self.optimizer, parameters, max_norm, queued, run.rows.read, self._before_optimizer_step
                )
        window = run.metrics.window
        window.record("train/nonfinite_steps", 0 if result.stepped else 1, Reduce.SUM)
        if result.stepped:
            window.record("grad_norm", result.grad_norm)
            self.control = self.callback_handler.on_optimizer_step(args, self.state, self.control)
            self.lr_scheduler.step()
        run.count_step(result, self.state.global_step + 1)
        model.zero_grad(set_to_none=True)
        return result

    def _before_optimizer_step(self) -> None:
        self.control = self.callback_handler.on_pre_optimizer_step(self.args, self.state, self.control)

    def _sync_weights_if_due(self, model, result: StepResult) -> None:
        """Every `weight_sync_steps` steps that changed the weights: a new policy version, pushed."""
        if result.stepped and (self.state.global_step + 1) % self.args.weight_sync_steps == 0:
            self._run.evaluations.join(None)  # an evaluation measures one policy: the sync waits for it
            self._push_weights(self.state.global_step + 1)

    def _push_weights(self, step: int) -> None:
        """A new policy version, pushed to the servers: the weights of global step `step`."""
        self._run.push_weights(self.accelerator.unwrap_model(self.model_wrapped), step)

    def _record_metrics(self, batch: StepBatch, result: StepResult, step_s: float) -> None:
        learning_rate = self.lr_scheduler.get_last_lr()[0]
        forwarded, padded = self._run.metrics.record_step(batch, result, step_s, learning_rate)
        # include_num_input_tokens_seen: the base Trainer's log() reports this count.
        self.state.num_input_tokens_seen += input_tokens_seen(self.args, forwarded, padded)
        self._run.session.collect_worker_metrics()

    def _count_consumed_prompts(self) -> None:
        """The state's epoch and the progress bar, from the steps taken and the prompts consumed."""
        run = self._run
        self.state.epoch = run.processes.broadcast(self._epoch() if run.processes.is_main else None)
        self._progress.advance_to(
            self.state.global_step if self.args.max_steps > 0 else run.ledger.epoch_prompts
        )

    def _end_step(self, epochs: EpochCallbacks) -> None:
        """The step counted (global step, epoch, progress), then the step-end callbacks."""
        args = self.args
        self.state.global_step += 1
        self._count_consumed_prompts()
        self.control = self.callback_handler.on_step_end(args, self.state, self.control)
        self.control = epochs.after_step(args, self.state, self.control)

    def _log_and_save(self, model, trial) -> None:
        self._run.checkpoints.check(self.control)  # a save in flight settled; a failed one due again
        if self.control.should_log:
            with timeline.span("log"):
                logs = self._run.metrics.flush()
                if self._run.session.mismatch_watch is not None:  # rank 0
                    self._run.session.mismatch_watch.check(logs, self.state.global_step)
                self.log(logs)
                if self.args.log_completions:
                    self._log_completions()
        if self.control.should_evaluate:
            self._start_eval(trial)
            if self.control.should_save or self.args.save_strategy == SaveStrategy.BEST:
                self._run.evaluations.join(trial)  # the checkpoint's "best" needs this step's figures
        if self.control.should_save:
            with timeline.span("checkpoint"):
                self._save_checkpoint(model, trial)
                self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _log_completions(self) -> None:
        """`log_completions`: the recent completions printed, and sent as a table to the trackers of
        `report_to` that show tables (W&B, trackio), on the main process."""
        step, args = self.state.global_step, self.args
        rows = self._run.metrics.take_completions(self.processing_class, step, args.num_completions_to_print)
        if rows and self.state.is_world_process_zero:
            print_completions(rows, step)
            log_to_trackers(rows, args.report_to)


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
