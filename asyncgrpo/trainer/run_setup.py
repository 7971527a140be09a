"""A train() call's set-up: what it holds around itself, and its per-run object, created in one place.

`holding_run_directory` keeps rank 0's hold on output_dir for the whole call; under
`sigterm_raises_keyboard_interrupt`, SIGTERM unwinds the call like Ctrl-C. `begin_run` creates the
run's `TrainingRun` (trainer/training_run.py) from explicit inputs: the prompt ledger, the metrics,
the checkpoints, the generation session, the evaluation schedule, the rows' pass and rank 0's
timeline. `prepare_model` makes the model to train and its optimizer through transformers' own
machinery (the base Trainer's, as trainer/checkpoint.py does). docs/architecture.md, "The trainer's
modules".
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from transformers import Trainer

from asyncgrpo.checkpoints.layout import choose_layout, is_sharded
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.generation.server_list import starting_servers
from asyncgrpo.run.lock import DirectoryInUseError, OwnerLock
from asyncgrpo.trainer.activation_memory import CheckpointToFit
from asyncgrpo.trainer.checkpoint import ResumePoint, load_sharded_checkpoint, load_sharded_optimizer
from asyncgrpo.trainer.checkpoint_saves import RunCheckpoints
from asyncgrpo.trainer.compile import compile_decoder_layers
from asyncgrpo.trainer.distributed import Processes, shard_model
from asyncgrpo.trainer.eval_schedule import EvaluationSchedule, Report
from asyncgrpo.trainer.fsdp_launch import FsdpLaunch
from asyncgrpo.trainer.fsdp_launch import announce as announce_fsdp_launch
from asyncgrpo.trainer.generation_session import GenerationSession
from asyncgrpo.trainer.loss_menu import LossMenu
from asyncgrpo.trainer.prompt_ledger import PromptLedger
from asyncgrpo.trainer.rollout_inputs import RolloutInputs
from asyncgrpo.trainer.rows_pass import RowsPass
from asyncgrpo.trainer.run_directory import hold_run_directory
from asyncgrpo.trainer.run_timeline import RunTimeline
from asyncgrpo.trainer.step_metrics import StepMetrics
from asyncgrpo.trainer.training_run import TrainingRun


@dataclass(frozen=True)
class EvaluationHooks:
    """What the run's evaluation schedule needs of the trainer: its eval datasets ({metric prefix:
    rows}, None without one), how figures are logged, how the servers catch up with the weights."""

    eval_rows: dict[str, list[dict]] | None
    report: Report
    catch_up: Callable[[], None]


@contextmanager
def holding_run_directory(processes: Processes, output_dir: str) -> Iterator[OwnerLock | None]:
    """Rank 0 holds output_dir for the whole train() call (trainer/run_directory.py) and gets the
    lock; with several processes every rank raises the refusal, so none waits in a collective for a
    rank that left."""
    refusal = lock = None
    if processes.is_main:
        try:
            lock = hold_run_directory(output_dir)
        except DirectoryInUseError as error:
            refusal = str(error)
    refusal = processes.broadcast(refusal)
    if refusal is not None:
        raise DirectoryInUseError(refusal)
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()


@contextmanager
def sigterm_raises_keyboard_interrupt() -> Iterator[None]:
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


def begin_run(
    args: AsyncGRPOConfig,
    processes: Processes,
    sharded: bool,
    resume: ResumePoint,
    policy: torch.nn.Module,
    optimizer,
    loss_menu: LossMenu,
    rollout: RolloutInputs,
    evaluation: EvaluationHooks,
    run_lock: OwnerLock | None,
) -> TrainingRun:
    """The run's parts, from where `resume` left them (a fresh run: an empty resume point). `policy`:
    the model trained, unwrapped (its size for the metrics, its activation memory with `optimizer`'s
    states); `loss_menu`: the rows' loss (GRPO's menu or a second trainer's); the session is opened by
    the loop."""
    prompts = resume.rollout
    ledger = PromptLedger(prompts.first_untrained_index, prompts.consumed_after, prompts.epoch_prompts)
    metrics = StepMetrics.for_model(policy, args, num_tokens=prompts.num_tokens)
    layout = choose_layout(args.checkpoint_format, processes.world_size)
    checkpoints = RunCheckpoints(processes, layout, args.checkpoint_async, sharded, metrics.window, run_lock)
    session = GenerationSession(processes, metrics.window, resume)
    evaluations = EvaluationSchedule(
        processes,
        session,
        args,
        rollout,
        evaluation.eval_rows,
        metrics.window,
        evaluation.report,
        evaluation.catch_up,
    )
    fit_checkpointing = CheckpointToFit.for_training(policy, optimizer, args, sharded)
    rows = RowsPass(processes, loss_menu, metrics.window, fit_checkpointing, args.device)
    # Rank 0 records the run's timeline (its own phases, the worker's and the servers' pauses).
    run_timeline = None
    if processes.is_main:
        servers = starting_servers(args.vllm_server_urls, args.vllm_server_urls_file)
        run_timeline = RunTimeline(args.output_dir, servers, lambda: session.worker)
    parts = (ledger, metrics, checkpoints, session, evaluations, rows)
    return TrainingRun(processes, sharded, *parts, run_timeline)


def prepare_model(
    trainer: Trainer,
    checkpoint: str | None,
    processes: Processes,
    sharded: bool,
    fsdp_launch: FsdpLaunch | None,
    compile_layers: dict | None,
) -> torch.nn.Module:
    """The model to train (wrapped, sharded, compiled as configured) and the trainer's optimizer."""
    if sharded:
        # FSDP2 applied here, not by accelerate: the packed forward must be registered with it.
        reshard = True
        if fsdp_launch is not None:
            reshard = fsdp_launch.reshard_after_forward
            if processes.is_main:
                announce_fsdp_launch(fsdp_launch)
        # A full checkpoint's weights are already in (Trainer.train loads them); a sharded one's are
        # read into the shards below.
        shard_model(trainer.model, reshard)
        trainer.create_optimizer_and_scheduler(num_training_steps=trainer.state.max_steps)
        model = trainer.model_wrapped = trainer.model
        if checkpoint and not is_sharded(checkpoint):
            load_sharded_optimizer(trainer, checkpoint)
    else:
        model, _ = trainer._prepare_for_training(trainer.state.max_steps, None, checkpoint)
    if checkpoint and is_sharded(checkpoint):
        load_sharded_checkpoint(trainer, checkpoint, processes)
    if compile_layers is not None:
        compile_decoder_layers(trainer.accelerator.unwrap_model(model), **compile_layers)
    return model
