"""`on_epoch_begin` / `on_epoch_end` for a loop that has no epoch loop, and what the schedule gives a
run that ends before `max_steps`.

An epoch here is a pass over the prompts (`state.epoch` is prompts consumed / dataset length, or
steps / max_steps for a streaming dataset), advanced by the steps, not a for loop over a dataloader
that could bracket it. So an epoch begins just before the first step taken in it, and ends after the
step that reaches the next whole epoch, or when training ends with the epoch still open, the two
points where the base Trainer calls these callbacks.
"""

from __future__ import annotations

from transformers import TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import CallbackHandler
from transformers.trainer_utils import IntervalStrategy, SaveStrategy


class EpochCallbacks:
    def __init__(self, handler: CallbackHandler):
        self.handler = handler
        self.open_epoch: int | None = (
            None  # the whole epoch whose on_epoch_begin ran and on_epoch_end did not
        )

    def before_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl
    ) -> TrainerControl:
        if self.open_epoch is None:
            self.open_epoch = int(state.epoch or 0)
            control = self.handler.on_epoch_begin(args, state, control)
        return control

    def after_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl
    ) -> TrainerControl:
        if self.open_epoch is not None and int(state.epoch or 0) > self.open_epoch:
            self.open_epoch = None
            control = self.handler.on_epoch_end(args, state, control)
        return control

    def finish(self, args: TrainingArguments, state: TrainerState, control: TrainerControl) -> TrainerControl:
        """Close the epoch still open when training ends."""
        if self.open_epoch is not None:
            self.open_epoch = None
            control = self.handler.on_epoch_end(args, state, control)
        return control


def ask_as_at_max_steps(args: TrainingArguments, state: TrainerState, control: TrainerControl) -> None:
    """Training ended before `max_steps` (the epochs' prompts consumed, or a pass without signal
    after training: docs/reliability.md): ask for the checkpoint and evaluation the base Trainer's
    schedule gives the step at `max_steps`, where this step had none."""
    step = state.global_step
    if step == 0:
        return
    if args.save_strategy == SaveStrategy.STEPS and step % state.save_steps != 0:
        control.should_save = True
    if (
        args.eval_strategy == IntervalStrategy.STEPS
        and step % state.eval_steps != 0
        and args.eval_delay <= step
    ):
        control.should_evaluate = True
