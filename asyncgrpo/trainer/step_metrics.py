"""Step metrics: what each optimizer step adds to the metrics window, and the window's flush.

The window gathers what the trainer, the rollout worker and the weight sync record between two log
lines; `flush` reduces it to the logged values. Every name is described in docs/metrics.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.modeling.perf import FlopModel, device_peak_flops, flop_model
from asyncgrpo.packing.tree_attention import padded_length
from asyncgrpo.records.metrics import MetricsWindow, Reduce, Stat
from asyncgrpo.records.sample import Sample
from asyncgrpo.trainer.completions_table import completion_rows
from asyncgrpo.trainer.intake import StepBatch
from asyncgrpo.trainer.overlap import overlap_figures

# `log_completions`: the newest samples kept for the table printed at each log line.
RECENT_SAMPLES_KEPT = 64


@dataclass
class StepResult:
    """What one optimizer step measured (its loss summed over rows and processes)."""

    loss: float
    fwd_s: float
    fwd_bwd_s: float
    optimizer_s: float = 0.0
    grad_norm: float = math.nan
    stepped: bool = False  # the loss and the gradient norm were finite: the weights changed


class StepMetrics:
    def __init__(
        self, flops: FlopModel | None, peak_flops: float | None, num_tokens: int, keep_samples: bool
    ):
        self.window = MetricsWindow()
        self.flops = flops  # None: a model family perf.py has no FLOP count for (no MFU logged)
        self.peak_flops = peak_flops  # None: a device or precision without a known peak
        self.num_tokens = num_tokens  # forwarded since the first run began: a checkpoint carries it
        self.train_loss_sum = 0.0  # losses of this run's steps that changed the weights
        self.keep_samples = keep_samples  # log_completions
        self.recent_samples: list[Sample] = []

    @classmethod
    def for_model(cls, model: torch.nn.Module, args: AsyncGRPOConfig, num_tokens: int) -> StepMetrics:
        """`num_tokens`: forwarded before this run (a checkpoint's count)."""
        if args.bf16:
            compute_dtype = torch.bfloat16
        elif args.fp16:
            compute_dtype = torch.float16
        else:
            compute_dtype = next(model.parameters()).dtype
        peak_flops = device_peak_flops(args.device, compute_dtype)
        return cls(flop_model(model), peak_flops, num_tokens, keep_samples=args.log_completions)

    def record_step(
        self, batch: StepBatch, result: StepResult, step_s: float, learning_rate: float
    ) -> tuple[int, int]:
        """The step's metrics into the window; returns its forwarded and padded row tokens."""
        window = self.window
        rows = [row for plan in batch.plans for row in plan.tries]
        forwarded = sum(plan_tokens for plan in batch.plans for plan_tokens in plan.row_tokens)
        unpacked = sum(sample.num_tokens for sample in batch.samples)
        trained = sum(sample.num_trained for sample in batch.samples)
        attention_pairs = sum(cost for plan in batch.plans for cost in plan.row_attention_costs)
        padded = sum(padded_length(tokens) for plan in batch.plans for tokens in plan.row_tokens if tokens)
        self.num_tokens += forwarded
        self.train_loss_sum += result.loss if result.stepped else 0.0
        window.record("loss", result.loss)
        window.record("learning_rate", learning_rate)
        window.record("num_tokens", self.num_tokens, Reduce.LAST)
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
        window.record("perf/fwd_bwd_s", result.fwd_bwd_s)
        window.record("perf/fwd_s", result.fwd_s)
        window.record("perf/optimizer_s", result.optimizer_s)
        window.record("perf/rollout_wait_s", batch.wait_s)
        window.add("perf/trainer_idle_frac", Stat(Reduce.RATE, batch.wait_s, step_s))
        window.record_rate("perf/fwd_bwd_forwarded_tokens_per_s", forwarded, result.fwd_bwd_s)
        window.record_rate("perf/wall_clock_forwarded_tokens_per_s", forwarded, step_s)
        window.record_rate("perf/wall_clock_trained_tokens_per_s", trained, step_s)
        if self.flops is not None and self.peak_flops:
            flops = self.flops.step_flops(forwarded, trained, attention_pairs)
            window.record_rate("perf/fwd_bwd_mfu", flops / self.peak_flops, result.fwd_bwd_s)
            window.record_rate("perf/wall_clock_mfu", flops / self.peak_flops, step_s)
        if self.keep_samples:
            self.recent_samples = (self.recent_samples + batch.samples)[-RECENT_SAMPLES_KEPT:]
        return forwarded, padded

    def flush(self) -> dict[str, float]:
        """The window's values to log (a value with nothing behind it, NaN, is left out); the window
        starts over."""
        record_window_overlap(self.window)
        logs = self.window.summarize()
        return {
            name: value
            for name, value in logs.items()
            if not (isinstance(value, float) and math.isnan(value))
        }

    def take_completions(self, processing_class, step: int, count: int | None) -> list[dict]:
        """`log_completions`: the rows of the newest `count` samples (all kept when None or 0), which
        leave the window."""
        samples = self.recent_samples
        self.recent_samples = []
        return completion_rows(samples[-(count or len(samples)) :], processing_class, step)


def record_window_overlap(window: MetricsWindow) -> None:
    """`perf/fixed_cost_s` and `perf/overlap_efficiency` of the window's mean step, from what it
    holds; nothing when it lacks a step or the worker's idle share (docs/metrics.md, "Overlap")."""
    stats = window.stats()

    def value(name: str, default: float = math.nan) -> float:
        return stats[name].result() if name in stats else default

    train_compute_s = value("perf/fwd_bwd_s") + value("perf/optimizer_s", 0.0)
    fixed_cost_s, efficiency = overlap_figures(
        value("perf/step_s"), train_compute_s, value("perf/generation_idle_frac")
    )
    if not math.isnan(fixed_cost_s):
        window.record("perf/fixed_cost_s", fixed_cost_s, Reduce.LAST)
        window.record("perf/overlap_efficiency", efficiency, Reduce.LAST)
