"""The loss of one packed row, and the step's row values read back from the device at once.

Each process forwards its own row of every micro-batch; a row's loss is normalized by counts of the
whole micro-batch or step over all processes (losses/aggregation.py), which every rank knows from the
plan (`StepLoss`). The rows' losses and metrics stay on the device while the step's rows are queued
(`QueuedRows`); `values_on_host` then reads them in one transfer, so the host never waits for the GPU
between two rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.errors import ContractError
from asyncgrpo.losses import AlgorithmSettings, LossTotals, algorithm_loss
from asyncgrpo.losses.off_policy import CorrectionSettings, mismatch_kl
from asyncgrpo.losses.policy_loss import LossInputs
from asyncgrpo.losses.regularizers import entropy_threshold, high_entropy_mask
from asyncgrpo.losses.token_logprobs import row_logprobs, to_device
from asyncgrpo.modeling.routing_replay import replay_routing
from asyncgrpo.packing.planner import MicroBatchPlan
from asyncgrpo.records.metrics import Reduce, Stat
from asyncgrpo.trainer.device_clock import DeviceClock
from asyncgrpo.trainer.reference_model import ReferenceModel


@dataclass
class QueuedRows:
    """A step's rows, forwarded and backpropagated on the device but not yet read by the host."""

    clock: DeviceClock
    marks: list[tuple]  # (started, forward done, backward done) device marks of each row
    losses: list[torch.Tensor]  # 0-d, rows this process counts
    stats: list[dict[str, Stat]]  # their metrics, values still on the device


def values_on_host(row_losses: list[torch.Tensor], row_stats: list[dict[str, Stat]]):
    """(sum of the rows' losses, the rows' metrics with float values): every device value in one
    transfer, so the step waits for the GPU once, after its last row."""
    device_values = [row_losses] + [
        [v for s in stats.values() for v in (s.value, s.weight)] for stats in row_stats
    ]
    tensors = [
        v.detach().double().reshape(()) for values in device_values for v in values if torch.is_tensor(v)
    ]
    host = iter(torch.stack(tensors).tolist() if tensors else [])

    def read(value) -> float:
        return next(host) if torch.is_tensor(value) else float(value)

    loss_total = sum(read(loss) for loss in row_losses)
    stats = [
        {name: Stat(s.reduce, read(s.value), read(s.weight)) for name, s in row.items()} for row in row_stats
    ]
    return loss_total, stats


def replayed_routing_of(model, row) -> contextlib.AbstractContextManager:
    """Forward and backward of `row` inside it: its MoE tokens go to the experts the sampler used,
    where its samples carry them (the backward too: a checkpointed layer routes again when it
    recomputes). A row without routings changes nothing."""
    if row.routed_experts is None:
        return contextlib.nullcontext()
    return replay_routing(model, torch.from_numpy(row.routed_experts), torch.from_numpy(row.routed))


def correction_settings(args: AsyncGRPOConfig) -> CorrectionSettings:
    return CorrectionSettings(
        enabled=args.vllm_importance_sampling_correction,
        mode=args.vllm_importance_sampling_mode,
        clip_min=args.vllm_importance_sampling_clip_min,
        clip_max=args.vllm_importance_sampling_clip_max,
        off_policy_mask_threshold=args.off_policy_mask_threshold,
    )


def algorithm_settings(args: AsyncGRPOConfig, entropy_coef: float = 0.0) -> AlgorithmSettings:
    """The loss's settings from the config; `entropy_coef`: the coefficient this step applies."""
    return AlgorithmSettings(
        loss_type=args.loss_type,
        score_centering=bool(args.score_centering),
        correction=correction_settings(args),
        epsilon=args.epsilon,
        epsilon_high=args.epsilon_high,
        importance_sampling_level=args.importance_sampling_level,
        delta=args.delta,
        sapo_temperature_pos=args.sapo_temperature_pos,
        sapo_temperature_neg=args.sapo_temperature_neg,
        vespo_parameters=(args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg),
        beta=args.beta,
        use_bias_correction_kl=args.use_bias_correction_kl,
        entropy_bonus=args.entropy_coef != 0.0 or args.use_adaptive_entropy,
        entropy_coef=entropy_coef,
    )


@dataclass(frozen=True)
class StepLoss:
    """What every row of a step shares: the loss's settings (this step's entropy coefficient in them),
    the step's counts, the reference, and how the micro-batch's entropy threshold is found."""

    settings: AlgorithmSettings
    trained_tokens: float  # the step's loss entries, every row of every process
    samples: float
    rows: int  # micro-batches x processes
    reference: ReferenceModel | None = None
    # (E,) entropies of this process's row -> the micro-batch's threshold over every process's row
    # (top_entropy_quantile < 1); None: over this row alone (one process).
    micro_batch_entropy_threshold: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def of_plans(
        cls, plans: list[MicroBatchPlan], world_size: int, settings: AlgorithmSettings, **parts
    ) -> StepLoss:
        rows = [samples for plan in plans for samples in plan.rows]
        return cls(
            settings,
            trained_tokens=float(sum(sample.num_trained for samples in rows for sample in samples)),
            samples=float(sum(len(samples) for samples in rows)),
            rows=len(plans) * world_size,
            **parts,
        )

    def totals(self, microbatch_trained_tokens: float, args: AsyncGRPOConfig) -> LossTotals:
        return LossTotals(
            step_trained_tokens=self.trained_tokens,
            step_samples=self.samples,
            step_rows=self.rows,
            microbatch_trained_tokens=microbatch_trained_tokens,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            max_completion_length=args.max_completion_length,
        )


def row_loss(
    model,
    row,
    num_trained_tokens_global: float,
    args: AsyncGRPOConfig,
    step: StepLoss | None = None,
    keep_logits: bool = False,
    policy_version: int | None = None,
) -> tuple[torch.Tensor, dict]:
    """The loss of one packed row (this process's share of a micro-batch) and its metrics.
    num_trained_tokens_global: the micro-batch's trained tokens over all processes. step: what the
    step's rows share (None: a step of this one row, gradient_accumulation_steps times). keep_logits:
    the fused head keeps the row's logits for backward (the row's memory plan has room for them).
    policy_version: the trainer's policy version, for sampling/mismatch_kl split by staleness (None:
    no split)."""
    if step is None:
        step = StepLoss(
            algorithm_settings(args, args.entropy_coef),
            trained_tokens=num_trained_tokens_global * args.gradient_accumulation_steps,
            samples=float(row.num_samples * args.gradient_accumulation_steps),
            rows=args.gradient_accumulation_steps,
        )
    aux_coef = args.router_aux_loss_coef or 0.0
    out = row_logprobs(
        model, row, temperature=args.temperature, router_aux_loss=aux_coef > 0, keep_logits=keep_logits
    )
    device = out.logprobs.device
    inputs = LossInputs(
        logprobs=out.logprobs,
        sampler_logprobs=to_device(row.sampler_logprobs, device),
        advantages=to_device(row.advantages, device),
        entry_sample=to_device(row.entry_sample, device),
        entropy=out.entropy,
        top_logprobs=out.top_logprobs,
        sampler_top_logprobs=to_device(row.top_logprobs, device),
        num_samples=int(row.entry_sample.max()) + 1 if len(row.entry_sample) else None,
    )
    if args.beta != 0.0:
        if step.reference is None:
            raise ContractError(
                "beta > 0 needs the step's reference model (StepLoss.reference, the LossMenu's)"
            )
        inputs.ref_logprobs = step.reference.row_logprobs(model, row, args.temperature)
    if args.top_entropy_quantile < 1.0:
        threshold_of = step.micro_batch_entropy_threshold
        threshold = (
            threshold_of(out.entropy)
            if threshold_of is not None
            else entropy_threshold(out.entropy, args.top_entropy_quantile)
        )
        inputs.policy_mask = high_entropy_mask(out.entropy, threshold)
    loss, metrics = algorithm_loss(inputs, step.settings, step.totals(num_trained_tokens_global, args))
    if policy_version is not None and row.num_entries:
        metrics.update(mismatch_by_staleness(inputs, row, policy_version))
    if out.aux_loss is not None:  # MoE: the row's share of the step's load-balancing loss
        share = row.num_entries / max(num_trained_tokens_global, 1.0) / args.gradient_accumulation_steps
        loss = loss + aux_coef * out.aux_loss * share
        metrics["aux_loss"] = Stat(
            Reduce.MEAN, out.aux_loss.detach() * row.num_entries, float(row.num_entries)
        )
    return loss, metrics


def mismatch_by_staleness(inputs: LossInputs, row, policy_version: int) -> dict[str, Stat]:
    """sampling/mismatch_kl/fresh_mean over entries of samples from the trainer's policy version (the
    sampler's numerics alone) and /stale_mean over older ones (numerics plus the policy's drift).
    Which entries are which is known on the host: a split with no entry is not logged."""
    stale_samples = row.sample_versions < policy_version  # (S,)
    stale = stale_samples[row.entry_sample]  # (E,) host
    kl = mismatch_kl(inputs.logprobs, inputs.sampler_logprobs)

    def mean_over(chosen: np.ndarray) -> tuple[torch.Tensor, float]:
        kept = torch.where(to_device(chosen, kl.device), kl, torch.zeros_like(kl))  # no host sync
        return kept.sum(), float(chosen.sum())

    metrics = {}
    if (~stale).any():
        metrics["sampling/mismatch_kl/fresh_mean"] = Stat(Reduce.MEAN, *mean_over(~stale))
    if stale.any():
        metrics["sampling/mismatch_kl/stale_mean"] = Stat(Reduce.MEAN, *mean_over(stale))
    return metrics
