"""How each loss type turns a row's per-token terms into its share of the step's loss.

Convention (as asyncgrpo's own losses): the step's gradient is the sum, over every row of every micro-batch
and every process, of the gradients of what `aggregate` returns (the trainer multiplies by the world
size before backward because FSDP averages). TRL states each normalization per process and micro-batch
of equal sizes; here rows are packed by tokens and hold different numbers of samples, so each is stated
over the step, where packing cannot change it (docs/algorithm.md, "Normalization of the loss types"):

| loss type | row's share |
| --- | --- |
| grpo, sapo | sum over the row's sequences of (their token mean) / the step's sequences |
| luspo | sum over the row's sequences of (their token sum) / the step's sequences |
| dr_grpo | token sum / (the step's sequences x max_completion_length) |
| dapo, cispo, vespo | token sum / the step's trained tokens |
| bnpo | the row's token mean / the step's rows (TRL's local batch is a row) |
| None (asyncgrpo's own) | token sum / (the micro-batch's trained tokens x gradient_accumulation_steps) |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncgrpo.losses.off_policy import per_sequence_sum


@dataclass(frozen=True)
class LossTotals:
    """The counts a row's normalization reads, known on every process from the step's plan before its
    first forward. Trained tokens count loss entries (a token shared by two samples is one entry of each)
    and include the tokens the correction masks."""

    step_trained_tokens: float
    step_samples: float
    step_rows: int  # processes x micro-batches, empty rows included
    microbatch_trained_tokens: float  # over every process's row of this micro-batch
    gradient_accumulation_steps: int
    max_completion_length: int

    def __post_init__(self):
        if not (self.step_trained_tokens > 0 and self.step_samples > 0 and self.step_rows > 0):
            raise ValueError(f"a step's totals must be positive (a step trains something), got {self}")
        if not self.microbatch_trained_tokens > 0:
            raise ValueError(
                "microbatch_trained_tokens must be > 0 (the micro-batch's trained tokens summed over all "
                f"processes), got {self.microbatch_trained_tokens}"
            )
        if self.gradient_accumulation_steps < 1:
            raise ValueError(
                f"gradient_accumulation_steps must be >= 1, got {self.gradient_accumulation_steps}"
            )


def aggregate(
    per_token: torch.Tensor,
    entry_sample: torch.Tensor,
    num_samples: int,
    loss_type: str | None,
    totals: LossTotals,
) -> torch.Tensor:
    """The row's share of the step's loss (0-d) from its (E,) per-token terms, masks already applied
    (masked entries 0: they stay in every count)."""
    if loss_type in ("grpo", "sapo", "luspo"):
        sums = per_sequence_sum(per_token, entry_sample, num_samples)
        if loss_type != "luspo":
            counts = per_sequence_sum(torch.ones_like(per_token.detach()), entry_sample, num_samples)
            sums = sums / counts.clamp(min=1.0)
        return sums.sum() / totals.step_samples
    if loss_type == "dr_grpo":
        return per_token.sum() / (totals.step_samples * totals.max_completion_length)
    if loss_type in ("dapo", "cispo", "vespo"):
        return per_token.sum() / totals.step_trained_tokens
    if loss_type == "bnpo":
        return per_token.sum() / max(len(per_token), 1) / totals.step_rows
    if loss_type is None:
        return per_token.sum() / (totals.microbatch_trained_tokens * totals.gradient_accumulation_steps)
    raise ValueError(f"loss_type={loss_type!r} has no normalization")
