"""Checkpoints: written whole or not at all, and read back when a run resumes.

Beyond the model, tokenizer, optimizer, scheduler, RNG and trainer state, a checkpoint carries a
`ResumePoint`: where the prompt stream resumes and the samples held but not trained yet, so a resumed
run neither trains a prompt twice nor skips one (docs/architecture.md, "Stopping, checkpoints and
resume"). The two layouts (asyncgrpo/checkpoints/layout.py): the full one, written here by rank 0
with the base Trainer's private save methods, and the sharded one, whose shards every rank writes
(trainer/checkpoint_saves.py) and whose small files rank 0 writes here. Either resumes.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import Trainer, TrainerState
from transformers.trainer import OPTIMIZER_NAME as OPTIMIZER_FILE
from transformers.trainer import SCHEDULER_NAME as SCHEDULER_FILE
from transformers.trainer import TRAINER_STATE_NAME as TRAINER_STATE_FILE
from transformers.trainer import TRAINING_ARGS_NAME as TRAINING_ARGS_FILE
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, rotate_checkpoints

from asyncgrpo.checkpoints.background import SaveResult
from asyncgrpo.checkpoints.layout import ShardedManifest
from asyncgrpo.checkpoints.live_model import save_consolidated
from asyncgrpo.checkpoints.sharded_state import load_training_state
from asyncgrpo.modeling.sharded import full_tensor
from asyncgrpo.records.sample import Sample
from asyncgrpo.rollout.prompts import PromptOrder
from asyncgrpo.run.durable_files import publish_directory, staging_path
from asyncgrpo.run.lock import DirectoryInUseError, OwnerLock
from asyncgrpo.trainer.algorithm_state import AlgorithmState
from asyncgrpo.trainer.distributed import Processes, full_state, load_optimizer_state
from asyncgrpo.trainer.held_samples import load_held_samples, save_held_samples
from asyncgrpo.trainer.optimizer_step import torch_optimizer
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


def write_full_checkpoint(
    trainer: Trainer,
    model,
    trial,
    resume: ResumePoint,
    processes: Processes,
    sharded: bool,
    lock: OwnerLock | None = None,
) -> SaveResult:
    """A checkpoint in the full layout (checkpoint_format="full", asyncgrpo/checkpoints/layout.py),
    written whole or not at all, and durable before older ones are rotated away: every file goes to a
    hidden staging directory, flushed to the disk and renamed `checkpoint-N` (asyncgrpo/run/durable_files.py),
    so neither a killed run nor a crashed host leaves a checkpoint that `resume_from_checkpoint=True`
    would pick half written. A failed write (a full disk) removes its staging directory and is
    returned, the same on every rank (checkpoints/failures.py retries it). With several processes
    every rank helps gather the full model and optimizer states and rank 0 writes the same files a
    single process writes. `lock`: the run directory's (rank 0), checked first: a run that lost its
    directory to another writes nothing."""
    started = time.perf_counter()
    run_directory = Path(trainer._get_output_dir(trial=trial))
    final = run_directory / f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    staging = staging_path(final)  # not a name get_last_checkpoint matches
    note_best_checkpoint(trainer, run_directory)
    refuse_if_taken_over(lock, run_directory, processes)
    gathered = full_state(model, trainer.optimizer) if sharded else None
    failure = None
    if processes.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        try:
            staging.mkdir(parents=True)
            write_checkpoint(trainer, staging, gathered, resume)
            publish_directory(staging, final)  # durable before anything older goes
            rotate_checkpoints(
                output_dir=str(run_directory),
                save_total_limit=trainer.args.save_total_limit,
                best_model_checkpoint=trainer.state.best_model_checkpoint,
            )
        except OSError as error:
            shutil.rmtree(staging, ignore_errors=True)  # a full disk: give back what it took
            failure = error
        if failure is None and trainer.args.push_to_hub:
            trainer._push_from_checkpoint(str(final))
    # No rank runs ahead of a checkpoint being written, and every rank learns how it went.
    described = processes.broadcast(f"rank 0: {type(failure).__name__}: {failure}" if failure else None)
    return SaveResult(trainer.state.global_step, time.perf_counter() - started, described, failure)


def refuse_if_taken_over(lock: OwnerLock | None, run_directory: Path, processes: Processes) -> None:
    """Before a checkpoint is written: a run that lost its directory to another writes none. Rank 0
    holds the lock; every rank raises, so none waits for a rank that left."""
    refusal = None
    if processes.is_main and lock is not None and not lock.held():
        refusal = (
            f"{run_directory}: another run took this directory over ({lock.path}); this run writes "
            "no checkpoint there (it would overwrite or rotate away the other run's)"
        )
    refusal = processes.broadcast(refusal)
    if refusal is not None:
        raise DirectoryInUseError(refusal)


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
    """Rank 0, the full layout: model, tokenizer, optimizer, scheduler, RNG, trainer and rollout states."""
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
    write_run_state(trainer, directory, resume)


def write_sharded_run_files(trainer: Trainer, model, directory: Path, resume: ResumePoint) -> None:
    """Rank 0, the sharded layout: what is the same on every rank (the model's config, the tokenizer,
    a PEFT adapter's config, the schedule), and the trainer and rollout states. The shards of the
    model and optimizer are every rank's (asyncgrpo/checkpoints/)."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    base.config.save_pretrained(directory)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(directory)
    trainer.processing_class.save_pretrained(directory)
    if hasattr(model, "peft_config"):
        model.peft_config[model.active_adapter].save_pretrained(directory)
    if not trainer.args.save_only_model:
        torch.save(trainer.lr_scheduler.state_dict(), directory / SCHEDULER_FILE)
        trainer._save_scaler(str(directory))
    write_run_state(trainer, directory, resume)


def write_run_state(trainer: Trainer, directory: Path, resume: ResumePoint) -> None:
    """The trainer state (with the stateful callbacks' states) and the resume point."""
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


def start_trainer_state(trainer: Trainer, args, checkpoint: str | None, streaming: bool) -> ResumePoint:
    """The trainer state of a train() call, fresh or the checkpoint's (the step count, the log history,
    what stateful callbacks saved; the run's `max_steps` stays), and the checkpoint's resume point."""
    max_steps = args.max_steps if args.max_steps > 0 else 2**62  # epochs end training (_should_stop)
    callbacks = trainer.callback_handler.callbacks + [trainer.control]
    trainer.state = TrainerState(stateful_callbacks=[cb for cb in callbacks if hasattr(cb, "state")])
    trainer.state.train_batch_size = trainer._train_batch_size
    trainer.state.max_steps = max_steps
    trainer.state.compute_steps(args, max_steps)
    if checkpoint is None:
        return ResumePoint()
    state_file = Path(checkpoint) / TRAINER_STATE_FILE
    if state_file.exists():
        trainer.state = TrainerState.load_from_json(str(state_file))
        trainer.state.max_steps = max_steps
        trainer._load_callback_state()
    resume = read_resume_point(checkpoint, streaming)
    if not streaming:
        # The prompt order (data_seed, train_sampling_strategy) must be the checkpoint's.
        resume.rollout.check_prompt_order(PromptOrder.of(args), checkpoint)
    return resume


def load_sharded_optimizer(trainer: Trainer, checkpoint: str) -> None:
    """Several processes: the checkpoint's full optimizer and scheduler states into the sharded
    optimizer (every rank calls it)."""
    state = torch.load(Path(checkpoint) / OPTIMIZER_FILE, weights_only=True)
    load_optimizer_state(trainer.model, trainer.optimizer, state)
    trainer.lr_scheduler.load_state_dict(torch.load(Path(checkpoint) / SCHEDULER_FILE, weights_only=True))


def load_sharded_checkpoint(trainer: Trainer, checkpoint: str, processes: Processes) -> None:
    """A sharded checkpoint's model, optimizer and schedule into the run's own (every rank, after the
    model is sharded and the optimizer made), whatever the number of processes that wrote it: each
    rank reads the pieces of its own shards (asyncgrpo/checkpoints/sharded_state.py)."""
    manifest = ShardedManifest.load(checkpoint)
    model = trainer.accelerator.unwrap_model(trainer.model)
    optimizer = torch_optimizer(trainer.optimizer)
    if load_training_state(model, optimizer, checkpoint, manifest, processes.distributed):
        trainer.lr_scheduler.load_state_dict(torch.load(Path(checkpoint) / SCHEDULER_FILE, weights_only=True))
    elif processes.is_main:
        logger.warning(
            "%s holds no optimizer state (written with save_only_model=True): the optimizer starts fresh",
            checkpoint,
        )
    if processes.is_main and manifest.world_size != processes.world_size:
        logger.info(
            "%s was written by %d process(es) and resumes on %d: its shards are read into this run's",
            checkpoint,
            manifest.world_size,
            processes.world_size,
        )


def load_sharded_weights(trainer: Trainer, checkpoint: str, processes: Processes) -> None:
    """A sharded checkpoint's model weights alone (load_best_model_at_end; every rank)."""
    manifest = ShardedManifest.load(checkpoint)
    model = trainer.accelerator.unwrap_model(trainer.model)
    load_training_state(model, None, checkpoint, manifest, processes.distributed)


def save_sharded_model(trainer: Trainer, output_dir: str) -> None:
    """`save_model` of a model sharded over several processes (every rank calls it): a consolidated
    Hugging Face folder, each tensor gathered in turn and rank 0 writing one file's worth at a time;
    for a PEFT model, the adapter (asyncgrpo/checkpoints/live_model.py)."""
    directory = Path(output_dir)
    writes = trainer.accelerator.is_main_process
    if writes:
        directory.mkdir(parents=True, exist_ok=True)
    model = trainer.accelerator.unwrap_model(trainer.model)
    if hasattr(model, "peft_config"):
        adapter = {
            name: full_tensor(p).detach().to("cpu") for name, p in model.named_parameters() if p.requires_grad
        }
        if writes:
            model.save_pretrained(directory, state_dict=adapter)
    else:
        save_consolidated(model, directory, writes)
        if writes:
            model.config.save_pretrained(directory)
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(directory)
    if writes:
        trainer.processing_class.save_pretrained(directory)
        torch.save(trainer.args, directory / TRAINING_ARGS_FILE)
    trainer.accelerator.wait_for_everyone()
