"""Checkpoints: written whole or not at all, and read back when a run resumes.

Beyond the base Trainer's files (model, tokenizer, optimizer, scheduler, RNG, trainer state), a
checkpoint carries a `ResumePoint`: where the prompt stream resumes and the samples held but not
trained yet, so a resumed run neither trains a prompt twice nor skips one (docs/architecture.md,
"Stopping, checkpoints and resume"). Writing calls the base Trainer's private save methods.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import Trainer, TrainerState
from transformers.trainer import OPTIMIZER_NAME as OPTIMIZER_FILE
from transformers.trainer import SCHEDULER_NAME as SCHEDULER_FILE
from transformers.trainer import TRAINER_STATE_NAME as TRAINER_STATE_FILE
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, rotate_checkpoints

from asyncgrpo.durable_files import publish_directory, staging_path
from asyncgrpo.rollout.prompts import PromptOrder
from asyncgrpo.run_lock import OwnerLock
from asyncgrpo.sample import Sample
from asyncgrpo.trainer.algorithm_state import AlgorithmState
from asyncgrpo.trainer.distributed import Processes, full_state, load_optimizer_state
from asyncgrpo.trainer.held_samples import load_held_samples, save_held_samples
from asyncgrpo.trainer.prompt_ledger import PromptLedger, RolloutState

logger = logging.getLogger(__name__)


@dataclass
class ResumePoint:
    """What a checkpoint carries beyond the base Trainer's files; empty for a fresh run."""

    rollout: RolloutState = field(default_factory=RolloutState)
    held_samples: list[Sample] = field(default_factory=list)
    algorithm: AlgorithmState = field(default_factory=AlgorithmState)  # the loss menu's state

    @classmethod
    def of_run(
        cls,
        ledger: PromptLedger,
        model_version: int,
        num_tokens: int,
        held_samples: list[Sample],
        prompt_order: PromptOrder,
        algorithm: AlgorithmState | None = None,
    ) -> ResumePoint:
        watermark, consumed_after = ledger.state()
        rollout = RolloutState(
            first_untrained_index=watermark,
            consumed_after=consumed_after,
            epoch_prompts=ledger.epoch_prompts,
            model_version=model_version,
            num_tokens=num_tokens,
            prompt_order=prompt_order,
        )
        return cls(rollout, held_samples, algorithm or AlgorithmState())


def save_checkpoint(
    trainer: Trainer,
    model,
    trial,
    resume: ResumePoint,
    processes: Processes,
    sharded: bool,
    lock: OwnerLock | None = None,
) -> None:
    """A checkpoint written whole or not at all, and durable before older ones are rotated away:
    every file goes to a hidden staging directory, flushed to the disk and renamed `checkpoint-N`
    (asyncgrpo/durable_files.py), so neither a killed run nor a crashed host leaves a checkpoint that
    `resume_from_checkpoint=True` would pick half written. A failed write (a full disk) removes its
    staging directory and raises. With several processes every rank helps gather the full model and
    optimizer states and rank 0 writes the same files a single process writes. `lock`: the run
    directory's (rank 0), checked first: a run that lost its directory to another writes nothing."""
    run_directory = Path(trainer._get_output_dir(trial=trial))
    final = run_directory / f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    staging = staging_path(final)  # not a name get_last_checkpoint matches
    note_best_checkpoint(trainer, run_directory)
    gathered = full_state(model, trainer.optimizer) if sharded else None
    if processes.is_main:
        if lock is not None and not lock.held():
            raise RuntimeError(
                f"{run_directory}: another run took this directory over ({lock.path}); this run writes "
                "no checkpoint there (it would overwrite or rotate away the other run's)"
            )
        shutil.rmtree(staging, ignore_errors=True)
        try:
            staging.mkdir(parents=True)
            write_checkpoint(trainer, staging, gathered, resume)
            publish_directory(staging, final)  # durable before anything older goes
        except OSError as error:
            shutil.rmtree(staging, ignore_errors=True)  # a full disk: give back what it took
            error.add_note(f"writing {final}: the checkpoints written before it are kept")
            raise
        rotate_checkpoints(
            output_dir=str(run_directory),
            save_total_limit=trainer.args.save_total_limit,
            best_model_checkpoint=trainer.state.best_model_checkpoint,
        )
        if trainer.args.push_to_hub:
            trainer._push_from_checkpoint(str(final))
    processes.gather(None)  # no rank runs ahead of a checkpoint being written


def note_best_checkpoint(trainer: Trainer, run_directory: Path) -> None:
    """As the base Trainer does when it saves: the checkpoint of the best evaluation so far
    (`best_global_step`, set from `metric_for_best_model`) becomes `best_model_checkpoint`, which
    rotation keeps and load_best_model_at_end loads. The one being written counts as there."""
    best = trainer.state.best_global_step
    if not best or trainer.args.save_strategy not in (
        SaveStrategy.STEPS,
        SaveStrategy.EPOCH,
        SaveStrategy.BEST,
    ):
        return
    directory = run_directory / f"{PREFIX_CHECKPOINT_DIR}-{best}"
    if best == trainer.state.global_step or directory.exists():
        trainer.state.best_model_checkpoint = str(directory)


def write_checkpoint(
    trainer: Trainer, directory: Path, gathered: tuple[dict, dict] | None, resume: ResumePoint
) -> None:
    """Rank 0: model, tokenizer, optimizer, scheduler, RNG, trainer and rollout states."""
    if gathered is None:
        trainer.save_model(str(directory), _internal_call=True)
        if not trainer.args.save_only_model:
            trainer._save_optimizer_and_scheduler(str(directory))
            trainer._save_scaler(str(directory))
            trainer._save_rng_state(str(directory))
    else:
        model_state, optimizer_state = gathered
        trainer.model.save_pretrained(directory, state_dict=model_state)
        trainer.processing_class.save_pretrained(directory)
        if not trainer.args.save_only_model:
            torch.save(optimizer_state, directory / OPTIMIZER_FILE)
            torch.save(trainer.lr_scheduler.state_dict(), directory / SCHEDULER_FILE)
    stateful = trainer.state.stateful_callbacks
    for callback in trainer.callback_handler.callbacks + [trainer.control]:
        if isinstance(callback, ExportableState):
            name = type(callback).__name__
            if isinstance(stateful.get(name), list):
                stateful[name].append(callback.state())
            else:
                stateful[name] = callback.state()
    trainer.state.save_to_json(str(directory / TRAINER_STATE_FILE))
    save_resume_point(directory, resume)


def save_resume_point(directory: Path, resume: ResumePoint) -> None:
    resume.rollout.save(directory)
    save_held_samples(resume.held_samples, directory)
    resume.algorithm.save(directory)


def read_resume_point(checkpoint: str, streaming: bool) -> ResumePoint:
    """The checkpoint's resume point. An IterableDataset cannot be repositioned: its stream restarts
    from the first prompt (with a warning), and the held samples are not restored."""
    rollout = RolloutState.load(checkpoint)
    if rollout is None:
        logger.warning(
            "%s has no rollout_state.json: the rollout worker restarts at the first prompt", checkpoint
        )
        rollout = RolloutState()
    if streaming:
        if rollout.first_untrained_index or rollout.consumed_after:
            logger.warning(
                "resuming with an IterableDataset: it cannot be repositioned, so the rollout worker "
                "restarts from its first prompt (prompts trained before the checkpoint will be seen "
                "again)"
            )
            rollout.first_untrained_index, rollout.consumed_after = 0, []
        return ResumePoint(rollout, algorithm=AlgorithmState.load(checkpoint))
    return ResumePoint(rollout, load_held_samples(checkpoint), AlgorithmState.load(checkpoint))


def restore_trainer_state(trainer: Trainer, checkpoint: str, max_steps: int) -> None:
    """The checkpoint's trainer state and callback states, when it has them (the step count, the log
    history, what stateful callbacks saved); the run's `max_steps` stays."""
    state_file = Path(checkpoint) / TRAINER_STATE_FILE
    if state_file.exists():
        trainer.state = TrainerState.load_from_json(str(state_file))
        trainer.state.max_steps = max_steps
        trainer._load_callback_state()


def load_sharded_optimizer(trainer: Trainer, checkpoint: str) -> None:
    """Several processes: the checkpoint's full optimizer and scheduler states into the sharded
    optimizer (every rank calls it)."""
    state = torch.load(Path(checkpoint) / OPTIMIZER_FILE, weights_only=True)
    load_optimizer_state(trainer.model, trainer.optimizer, state)
    trainer.lr_scheduler.load_state_dict(torch.load(Path(checkpoint) / SCHEDULER_FILE, weights_only=True))
