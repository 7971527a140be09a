"""A train() call's set-up: everything the run trains with and counts, created in one place.

`RunSetup` is a part of AsyncGRPOTrainer (a base class of it, never used alone): `_begin_run` creates
the processes, the trainer state (fresh, or the checkpoint's: `_restore_state`), the model to train
and its optimizer (`_prepare_model`), the prompt ledger, the metrics, the generation session and rank
0's timeline; `_close_timeline` writes the timeline once the run ends, also after a failure
(docs/architecture.md, "The trainer's modules"). Where the run meets its checkpoints is here too:
`_resume_point` (what a checkpoint carries beyond the weights), and the Trainer overrides
`_load_from_checkpoint` and `save_model` (a model sharded over several processes, streamed).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from transformers import TrainerState

from asyncgrpo import timeline
from asyncgrpo.checkpoints.layout import choose_layout, is_sharded
from asyncgrpo.checkpoints.live_model import is_sharded_module
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.cpu_use import CpuSampler, Tracked
from asyncgrpo.rollout.prompts import PromptOrder
from asyncgrpo.run_files import TIMELINE_FILE
from asyncgrpo.run_lock import DirectoryInUseError, OwnerLock
from asyncgrpo.trainer.activation_memory import CheckpointToFit
from asyncgrpo.trainer.checkpoint import (
    ResumePoint,
    load_sharded_checkpoint,
    load_sharded_optimizer,
    read_resume_point,
    restore_trainer_state,
    save_sharded_model,
)
from asyncgrpo.trainer.checkpoint_saves import RunCheckpoints
from asyncgrpo.trainer.checks import check_launch, check_multi_process
from asyncgrpo.trainer.compile import compile_decoder_layers
from asyncgrpo.trainer.distributed import Processes, shard_model
from asyncgrpo.trainer.fsdp_launch import announce as announce_fsdp_launch
from asyncgrpo.trainer.generation_session import GenerationSession
from asyncgrpo.trainer.prompt_ledger import PromptLedger
from asyncgrpo.trainer.run_directory import hold_run_directory
from asyncgrpo.trainer.step_metrics import StepMetrics

logger = logging.getLogger(__name__)


class RunSetup:
    """AsyncGRPOTrainer's set-up of a train() call; it reads the trainer's `accelerator`, `args`,
    `model`, `optimizer`, `callback_handler`, `streaming`, `_fsdp_launch`, `_compile_layers` and
    `_loss_menu`."""

    _run_lock: OwnerLock | None = None  # rank 0's hold on output_dir while train() runs

    @contextmanager
    def _holding_run_directory(self) -> Iterator[None]:
        """Rank 0 holds output_dir for the whole train() call (trainer/run_directory.py); with several
        processes every rank raises the refusal, so none waits in a collective for a rank that left."""
        processes = Processes(self.accelerator.num_processes, self.accelerator.process_index)
        refusal = lock = None
        if processes.is_main:
            try:
                lock = hold_run_directory(self.args.output_dir)
            except DirectoryInUseError as error:
                refusal = str(error)
        refusal = processes.broadcast(refusal)
        if refusal is not None:
            raise DirectoryInUseError(refusal)
        self._run_lock = lock
        try:
            yield
        finally:
            self._run_lock = None
            if lock is not None:
                lock.release()

    def _begin_run(self, args: AsyncGRPOConfig, checkpoint: str | None, trial) -> torch.nn.Module:
        """Everything one train() call trains with and counts, created here: the processes, the
        trainer state (fresh or the checkpoint's), the model to train and its optimizer, the ledger,
        the metrics and the generation session (opened by the loop). Returns the model to train."""
        check_launch(self.accelerator.num_processes, args.use_cpu)
        self._processes = Processes(self.accelerator.num_processes, self.accelerator.process_index)
        self._sharded = self._processes.distributed or self._fsdp_launch is not None
        if self._processes.distributed:
            check_multi_process(self.is_deepspeed_enabled, self.optimizer is not None)
        self.accelerator.free_memory()
        resume = self._restore_state(args, checkpoint)
        model = self._prepare_model(args, checkpoint)
        reshard = self._fsdp_launch.reshard_after_forward if self._fsdp_launch is not None else True
        self._loss_menu.prepare(
            self._processes, self._sharded, reshard, self._compile_layers, resume.algorithm
        )
        self.state.init_training_references(self, self.state.max_steps, args.num_train_epochs, trial)
        self._fit_checkpointing = CheckpointToFit.for_training(
            self.accelerator.unwrap_model(model), self.optimizer, args, self._sharded
        )
        rollout = resume.rollout
        self._ledger = PromptLedger(
            rollout.first_untrained_index, rollout.consumed_after, rollout.epoch_prompts
        )
        self._nonfinite_streak = 0  # steps skipped in a row for a non-finite loss or gradient norm
        self._served_step = -1  # the global step whose weights the servers run (-1: not pushed yet)
        self._metrics = StepMetrics.for_model(self.model, args, num_tokens=rollout.num_tokens)
        self._checkpoints = RunCheckpoints(
            self._processes,
            choose_layout(args.checkpoint_format, self._processes.world_size),
            args.checkpoint_async,
            self._sharded,
            self._metrics.window,
            self._run_lock,
        )
        self._session = GenerationSession(self._processes, self._metrics.window, resume)
        # Rank 0 records the run's timeline (its own phases, the worker's and the servers' pauses).
        # Its CPU counters: which process held which core when (asyncgrpo/cpu_use.py).
        self._timeline = self._cpu_sampler = None
        if self._processes.is_main:
            self._timeline = timeline.TimelineRecorder(Path(args.output_dir) / TIMELINE_FILE)
            timeline.activate(self._timeline)
            self._cpu_sampler = CpuSampler(
                self._timeline.add_counter, self._own_processes, args.vllm_server_urls
            )
            self._cpu_sampler.start()
        return model

    def _own_processes(self) -> list[Tracked]:
        """The run's processes whose CPU use the timeline shows: this one and the rollout workers."""
        found = [(timeline.TRAINER, timeline.TRAINER, os.getpid())]
        pool = self._session.worker
        processes = pool.processes if pool is not None else []
        for index, process in enumerate(processes):
            if process is not None and process.pid is not None:
                name = timeline.worker_process(index, len(processes))
                found.append((name, name, process.pid))
        return found

    def _close_timeline(self) -> None:
        """The timeline's last write (also after a failure: the file shows where the run stopped)."""
        if self._timeline is not None:
            self._cpu_sampler.stop()
            timeline.activate(None)
            try:
                self._timeline.write()
            except OSError as error:  # a full disk must not hide the run's own error
                logger.warning("could not write %s: %s", self._timeline.path, error)

    def _restore_state(self, args: AsyncGRPOConfig, checkpoint: str | None) -> ResumePoint:
        """The trainer state, fresh or the checkpoint's, and the checkpoint's resume point."""
        max_steps = args.max_steps if args.max_steps > 0 else 2**62  # epochs end training (_should_stop)
        self.state = TrainerState(
            stateful_callbacks=[
                cb for cb in self.callback_handler.callbacks + [self.control] if hasattr(cb, "state")
            ]
        )
        self.state.train_batch_size = self._train_batch_size
        self.state.max_steps = max_steps
        self.state.compute_steps(args, max_steps)
        if checkpoint is None:
            return ResumePoint()
        restore_trainer_state(self, checkpoint, max_steps)
        resume = read_resume_point(checkpoint, self.streaming)
        if not self.streaming:
            # The prompt order (data_seed, train_sampling_strategy) must be the checkpoint's.
            resume.rollout.check_prompt_order(PromptOrder.of(args), checkpoint)
        return resume

    def _resume_point(self) -> ResumePoint:
        """What a checkpoint of this run carries beyond the weights and the optimizer."""
        return ResumePoint.of_run(
            self._ledger,
            self._session.model_version,
            self._metrics.num_tokens,
            self._session.held_samples(),
            PromptOrder.of(self.args),
            self._loss_menu.state(),
        )

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model`; a model sharded over several processes (every rank calls it): streamed,
        consolidated (trainer/checkpoint.py, `save_sharded_model`)."""
        if _internal_call or not is_sharded_module(self.model):
            super().save_model(output_dir, _internal_call)
        else:
            save_sharded_model(self, output_dir or self.args.output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Overrides Trainer's (called by `Trainer.train`): a full checkpoint's weights, as the base
        Trainer loads them; a sharded one's are read into the shards by `_prepare_model`."""
        if not is_sharded(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _prepare_model(self, args: AsyncGRPOConfig, resume_from_checkpoint: str | None):
        """The model to train (wrapped, sharded, compiled as configured) and its optimizer."""
        if self._sharded:
            # FSDP2 applied here, not by accelerate: the packed forward must be registered with it.
            reshard = True
            if self._fsdp_launch is not None:
                reshard = self._fsdp_launch.reshard_after_forward
                if self._processes.is_main:
                    announce_fsdp_launch(self._fsdp_launch)
            # A full checkpoint's weights are already in (Trainer.train loads them); a sharded one's
            # are read into the shards below.
            shard_model(self.model, reshard)
            self.create_optimizer_and_scheduler(num_training_steps=self.state.max_steps)
            model = self.model_wrapped = self.model
            if resume_from_checkpoint and not is_sharded(resume_from_checkpoint):
                load_sharded_optimizer(self, resume_from_checkpoint)
        else:
            model, _ = self._prepare_for_training(self.state.max_steps, None, resume_from_checkpoint)
        if resume_from_checkpoint and is_sharded(resume_from_checkpoint):
            load_sharded_checkpoint(self, resume_from_checkpoint, self._processes)
        if self._compile_layers is not None:
            compile_decoder_layers(self.accelerator.unwrap_model(model), **self._compile_layers)
        return model
