"""A step's rows through the model on this process: the tree-packed forward and backward of every
micro-batch, queued (`forward_backward`), then read back from the device at once (`read`).

Nothing in `forward_backward` waits for the GPU (timings are device events, losses and metrics stay on
the device), so the host packs and uploads the next row while the GPU runs the previous one; `read`
then waits once, after the step's last row (trainer/row_loss.py, `values_on_host`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable

import torch

from asyncgrpo.records.metrics import MetricsWindow
from asyncgrpo.run import timeline
from asyncgrpo.trainer.activation_memory import CheckpointToFit
from asyncgrpo.trainer.device_clock import DeviceClock
from asyncgrpo.trainer.distributed import Processes
from asyncgrpo.trainer.intake import StepBatch
from asyncgrpo.trainer.loss_menu import LossMenu
from asyncgrpo.trainer.row_loss import QueuedRows, replayed_routing_of, values_on_host
from asyncgrpo.trainer.step_metrics import StepResult


class RowsPass:
    """This process's rows of each step, with the run's loss (`loss_menu`: GRPO's menu or a second
    trainer's loss) and, when sized to each row, its activation checkpointing."""

    def __init__(
        self,
        processes: Processes,
        loss_menu: LossMenu,
        window: MetricsWindow,
        fit_checkpointing: CheckpointToFit | None,
        device: torch.device,
    ):
        self.processes = processes
        self.loss_menu = loss_menu
        self.window = window
        self.fit_checkpointing = fit_checkpointing
        self.device = device

    def forward_backward(
        self,
        model: torch.nn.Module,
        batch: StepBatch,
        backward: Callable[[torch.Tensor], None],
        loss_context: Callable[[], AbstractContextManager],
        substep_end: Callable[[], None],
    ) -> QueuedRows:
        """Every micro-batch's row of this process, forwarded under `loss_context` (autocast) and
        backpropagated with `backward` (the accelerator's); `substep_end` after each micro-batch but
        the step's last, the base Trainer's point."""
        clock = DeviceClock(self.device)
        world, rank = self.processes.world_size, self.processes.rank
        row_marks, row_losses, row_stats = [], [], []
        step = self.loss_menu.step_loss(batch)
        for index, plan in enumerate(batch.plans):
            if index:
                substep_end()
            with timeline.span("pack", rows=len(plan.rows)):
                rows = plan.pack()
            row, weight = rows[rank], 1.0
            entries_global = float(sum(r.num_entries for r in rows))
            if row.num_entries == 0:
                if not self.processes.distributed:
                    continue
                # FSDP2 needs every rank in every forward/backward: borrow a row, count it zero times.
                row, weight = next(r for r in rows if r.num_entries), 0.0
            keep_logits = self._plan_memory(row.num_tokens, row.num_entries)
            started = clock.mark()
            with replayed_routing_of(model, row):
                with loss_context(), timeline.span("forward", tokens=row.num_tokens):
                    row_step = self.loss_menu.for_row(step, counted=weight > 0)
                    loss, stats = self.loss_menu.row_loss(
                        model, row, entries_global, row_step, keep_logits, batch.model_version
                    )
                forward_done = clock.mark()
                # FSDP2 averages gradients over processes; the loss is already normalized globally.
                with timeline.span("backward", tokens=row.num_tokens):
                    backward(loss * (world * weight))
            row_marks.append((started, forward_done, clock.mark()))
            if weight:
                row_losses.append(loss.detach())
                row_stats.append(stats)
        return QueuedRows(clock, row_marks, row_losses, row_stats)

    def _plan_memory(self, num_tokens: int, num_entries: int) -> bool:
        """The row's activation checkpointing, when sized to each row; whether the head keeps its logits."""
        if self.fit_checkpointing is None:
            return False
        memory_plan = self.fit_checkpointing.before_row(num_tokens, num_entries)
        self.window.record("perf/checkpointed_layers", memory_plan.checkpointed_layers)
        self.window.record("perf/head_logits_kept", float(memory_plan.keep_logits))
        return memory_plan.keep_logits

    def read(self, queued: QueuedRows) -> StepResult:
        """The step's loss and forward/backward times (its optimizer part still to fill in); the
        rows' metrics go to the window. Waits for the device, once."""
        clock = queued.clock
        fwd_s = sum(clock.seconds(started, forward_done) for started, forward_done, _ in queued.marks)
        fwd_bwd_s = sum(clock.seconds(started, done) for started, _, done in queued.marks)
        with timeline.span("read rows"):  # on a GPU: where the host waits for the device
            loss_total, row_stats = values_on_host(queued.losses, queued.stats)
        gathered = self.processes.gather((loss_total, row_stats))
        for _, stats_of_rank in gathered:
            for stats in stats_of_rank:
                self.window.merge(stats)
        self.loss_menu.observe([stats for _, stats_of_rank in gathered for stats in stats_of_rank])
        return StepResult(loss=sum(rank_loss for rank_loss, _ in gathered), fwd_s=fwd_s, fwd_bwd_s=fwd_bwd_s)
