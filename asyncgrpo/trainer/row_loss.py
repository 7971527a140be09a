"""The loss of one packed row, and the step's row values read back from the device at once.

Each process forwards its own row of every micro-batch; a row's loss is normalized by the trained
tokens of the whole micro-batch over all processes. The rows' losses and metrics stay on the device
while the step's rows are queued (`QueuedRows`); `values_on_host` then reads them in one transfer,
so the host never waits for the GPU between two rows.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.logprobs import row_logprobs, to_device
from asyncgrpo.loss import LossInputs
from asyncgrpo.metrics import Reduce, Stat
from asyncgrpo.off_policy import CorrectionSettings, mismatch_kl
from asyncgrpo.routing_replay import replay_routing
from asyncgrpo.trainer.device_clock import DeviceClock


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


def row_loss(
    model,
    row,
    num_trained_tokens_global: float,
    args: AsyncGRPOConfig,
    loss_fn,
    keep_logits: bool = False,
    policy_version: int | None = None,
) -> tuple[torch.Tensor, dict]:
    """The loss of one packed row (this process's share of a micro-batch), normalized by the trained
    tokens of the whole micro-batch over all processes, and its metrics. keep_logits: the fused head
    keeps the row's logits for backward (the row's memory plan has room for them). policy_version:
    the trainer's policy version, for sampling/mismatch_kl split by staleness (None: no split)."""
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
    loss, metrics = loss_fn(
        inputs,
        correction=correction_settings(args),
        epsilon=args.epsilon,
        epsilon_high=args.epsilon_high,
        num_trained_tokens_global=num_trained_tokens_global,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
    )
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
