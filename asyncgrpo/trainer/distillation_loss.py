"""The loss AsyncDistillationTrainer trains with, in the place of GRPO's loss menu (the same interface as
`LossMenu`, which the training loop calls): one packed row's generalized JSD to its teachers.

Each entry's support comes from its teacher's report (`teacher_support`); the student's exact log-probs
at the support ids come from the row's forward and the chunked output head
(asyncgrpo/losses/token_logprobs.py: the (entries x vocabulary) logits never exist at once), at
`teacher_temperature`; the divergence is
`distillation_divergence` (asyncgrpo/losses/distillation.py). As in TRL 1.16, a row's loss is the sum of
its entries' divergences over the micro-batch's trained tokens on every process, over the gradient
accumulation steps. Nothing lives across steps: no reference, no coefficient (docs/distillation.md).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from asyncgrpo.config import AsyncDistillationConfig
from asyncgrpo.errors import ContractError
from asyncgrpo.losses.distillation import distillation_divergence, teacher_support
from asyncgrpo.losses.token_logprobs import row_logprobs, to_device
from asyncgrpo.records.metrics import MetricsWindow, Reduce, Stat
from asyncgrpo.trainer.algorithm_state import AlgorithmState
from asyncgrpo.trainer.intake import StepBatch


class DistillationLoss:
    def __init__(self, args: AsyncDistillationConfig):
        self.args = args
        self.teacher_ids = list(args.teacher_server_urls)

    def prepare(self, processes, sharded, reshard, compile_options, resumed: AlgorithmState) -> None:
        """Nothing to place on the device nor to restore."""

    def step_loss(self, batch: StepBatch) -> None:
        """Nothing the step's rows share beyond the micro-batch's token count each row is given."""

    def for_row(self, step: None, counted: bool) -> None:
        return step

    def observe(self, row_stats: list[dict[str, Stat]]) -> None:
        """Nothing reads the rows' metrics across steps."""

    def after_step(self, window: MetricsWindow, policy: torch.nn.Module, step: int) -> None:
        """Nothing to update after the optimizer step."""

    def state(self) -> AlgorithmState:
        return AlgorithmState(None, None)

    def row_loss(
        self, model, row, entries_global: float, step: None, keep_logits: bool, policy_version: int
    ) -> tuple[torch.Tensor, dict[str, Stat]]:
        """One packed row's loss (its share of the micro-batch's mean divergence per trained token) and
        its metrics: `jsd`, `entropy` (the student's, full vocabulary, at teacher_temperature) and
        `teacher_entropy` over the entries its teacher scored, and per teacher with several (MOPD)."""
        args = self.args
        if row.teacher_ids is None:
            raise ContractError(
                "a row reached the distillation loss without the teacher's scores: its samples were not "
                "scored by a teacher (a custom rollout loop must keep Sample.teacher_ids)"
            )
        targets = torch.from_numpy(row.target_ids)
        support_ids, support_logprobs, valid = teacher_support(
            torch.from_numpy(row.teacher_ids), torch.from_numpy(row.teacher_logprobs), targets, args.beta
        )
        # The student's log-probs at the support ids: the sampler's top-N slot of the row, over the whole
        # vocabulary (the divergence's student is the model's own softmax, not the sampler's candidate set).
        view = dataclasses.replace(
            row, top_ids=support_ids.numpy(), candidate_offsets=None, candidate_ids=None
        )
        aux_coef = args.router_aux_loss_coef or 0.0
        out = row_logprobs(
            model,
            view,
            temperature=args.teacher_temperature,
            router_aux_loss=aux_coef > 0,
            keep_logits=keep_logits,
        )
        device = out.logprobs.device
        divergence = distillation_divergence(
            out.top_logprobs,
            support_logprobs.to(device),
            valid.to(device),
            args.beta,
            args.add_tail_bucket,
        )
        scale = max(entries_global, 1.0) * args.gradient_accumulation_steps
        loss = divergence.jsd.sum() / scale
        scored_host = valid.any(dim=-1).numpy()  # (E,) known on the host: no device sync
        scored = divergence.scored
        count = float(scored_host.sum())
        metrics = {
            "jsd": Stat(Reduce.MEAN, divergence.jsd.detach().sum(), count),
            "entropy": Stat(Reduce.MEAN, torch.where(scored, out.entropy.detach(), 0.0).sum(), count),
            "teacher_entropy": Stat(Reduce.MEAN, divergence.teacher_entropy.sum(), count),
        }
        if len(self.teacher_ids) > 1:
            metrics.update(self._per_teacher(row, divergence, scored_host, device))
        if out.aux_loss is not None:  # MoE: the row's share of the step's load-balancing loss
            share = row.num_entries / max(entries_global, 1.0) / args.gradient_accumulation_steps
            loss = loss + aux_coef * out.aux_loss * share
            metrics["aux_loss"] = Stat(
                Reduce.MEAN, out.aux_loss.detach() * row.num_entries, float(row.num_entries)
            )
        return loss, metrics

    def _per_teacher(self, row, divergence, scored_host: np.ndarray, device) -> dict[str, Stat]:
        """MOPD: `teacher_jsd/<id>`, `teacher_entropy/<id>` over the entries each teacher scored, and
        `teacher_token_frac/<id>`, its share of the scored entries (TRL 1.16's names)."""
        entry_teacher = row.sample_teachers[row.entry_sample]  # (E,) host
        total = float(scored_host.sum())
        metrics = {}
        for index, teacher_id in enumerate(self.teacher_ids):
            chosen = scored_host & (entry_teacher == index)
            count = float(chosen.sum())
            metrics[f"teacher_token_frac/{teacher_id}"] = Stat(Reduce.MEAN, count, total)
            if not count:
                continue
            mask = to_device(chosen, device)
            metrics[f"teacher_jsd/{teacher_id}"] = Stat(
                Reduce.MEAN, torch.where(mask, divergence.jsd.detach(), 0.0).sum(), count
            )
            metrics[f"teacher_entropy/{teacher_id}"] = Stat(
                Reduce.MEAN, torch.where(mask, divergence.teacher_entropy, 0.0).sum(), count
            )
        return metrics
