"""The on-policy distillation loss: a generalized Jensen-Shannon divergence between the student and a
teacher over a sparse support of token ids per trained token (docs/distillation.md, "The loss").

The teacher reports, per position, its top-k tokens plus the realized token (vLLM's `prompt_logprobs`).
Which of those ids the divergence runs over depends on `beta`, as in TRL 1.16 (`teacher_support`):
beta = 0 (forward KL) the whole reported support, beta = 1 (reverse KL) the realized token alone,
between them the teacher's top-1 and the realized token. The student's log-probs at those ids are exact
(the trainer gathers them from its full softmax, chunked over the entries:
asyncgrpo/losses/token_logprobs.py). A tail bucket (`add_tail_bucket`) holds the mass outside the support on
each side, so both sides are proper distributions over support + 1 outcomes; without it both are renormalized
over the support. Pure tensor functions: the trainer's row loss calls them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# log(sum of the support's mass) is kept below this, so the tail bucket's mass stays > 0 (its log finite).
MAX_SUPPORT_LOG_MASS = -1e-7


def teacher_support(
    teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor, target_ids: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The support the divergence runs over, per entry: (ids (E, W), the teacher's log-probs at them
    (E, W), valid (E, W) bool).

    teacher_ids / teacher_logprobs: (E, K) the teacher's reported tokens, rank order (its top-1 first),
    -1 / -inf padded; target_ids: (E,) the realized tokens. beta = 0: the reported ids (W = K). beta = 1:
    the realized token alone (W = 1), valid where the teacher reported it. Otherwise the top-1 and the
    realized token (W = 2), the second left out when it is the top-1."""
    reported = teacher_ids >= 0
    if beta == 0.0:
        return teacher_ids, teacher_logprobs, reported
    is_realized = reported & (teacher_ids == target_ids[:, None])
    realized_logprob = torch.where(is_realized, teacher_logprobs, -torch.inf).amax(dim=-1)  # (E,)
    realized_valid = is_realized.any(dim=-1)
    if beta == 1.0:
        return target_ids[:, None], realized_logprob[:, None], realized_valid[:, None]
    ids = torch.stack([teacher_ids[:, 0], target_ids], dim=-1)
    logprobs = torch.stack([teacher_logprobs[:, 0], realized_logprob], dim=-1)
    valid = torch.stack([reported[:, 0], realized_valid & (target_ids != teacher_ids[:, 0])], dim=-1)
    return ids, logprobs, valid


def with_tail_bucket(logprobs: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, W) log-probs over a support (-inf where not valid) -> (E, W + 1): the last column is the log
    of the mass outside the support, log(1 - sum exp), the sum kept below exp(MAX_SUPPORT_LOG_MASS)."""
    log_mass = torch.logsumexp(logprobs, dim=-1, keepdim=True).clamp(max=MAX_SUPPORT_LOG_MASS)
    tail = torch.log(-torch.expm1(log_mass))
    return torch.cat([logprobs, tail], dim=-1), torch.cat([valid, torch.ones_like(valid[:, :1])], dim=-1)


def generalized_jsd(
    student: torch.Tensor, teacher: torch.Tensor, valid: torch.Tensor, beta: float
) -> torch.Tensor:
    """(E, W) terms of the generalized JSD between two distributions given as log-probs over the same
    outcomes; summed over the last axis it is the divergence. With M = (1 - beta) S + beta T:
    beta x KL(T || M) + (1 - beta) x KL(S || M), which is KL(T || S) at beta = 0 and KL(S || T) at
    beta = 1 (computed as such). Outcomes not `valid`, and 0 x log 0, add 0."""
    zero = torch.zeros_like(student)
    student_log = torch.where(valid, student, zero)
    teacher_log = torch.where(valid, teacher, zero)
    student_p = torch.where(valid, student.exp(), zero)
    teacher_p = torch.where(valid, teacher.exp(), zero)
    if beta == 0.0:
        return torch.nan_to_num(teacher_p * (teacher_log - student_log), nan=0.0)
    if beta == 1.0:
        return torch.nan_to_num(student_p * (student_log - teacher_log), nan=0.0)
    mixture = (1.0 - beta) * student_p + beta * teacher_p
    mixture_log = torch.where(valid, mixture.clamp_min(torch.finfo(mixture.dtype).tiny).log(), zero)
    to_teacher = torch.nan_to_num(teacher_p * (teacher_log - mixture_log), nan=0.0)
    to_student = torch.nan_to_num(student_p * (student_log - mixture_log), nan=0.0)
    return beta * to_teacher + (1.0 - beta) * to_student


@dataclass
class Divergence:
    """Per entry (E,): the divergence (gradient through the student), the teacher's entropy over the
    same outcomes, and whether the teacher gave the entry any support (an entry without is left out:
    it would compare two copies of a 100% tail)."""

    jsd: torch.Tensor
    teacher_entropy: torch.Tensor
    scored: torch.Tensor  # bool


def distillation_divergence(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    valid: torch.Tensor,
    beta: float,
    add_tail_bucket: bool = True,
) -> Divergence:
    """The per-entry generalized JSD over a support (`teacher_support`'s): student_logprobs (E, W) the
    student's exact log-probs at the support ids, teacher_logprobs (E, W) the teacher's, valid (E, W).
    With `add_tail_bucket` both sides gain the outcome "outside the support"; without, both are
    renormalized over it. Entries with no valid id get 0 (and `scored` False)."""
    scored = valid.any(dim=-1)
    student = torch.where(valid, student_logprobs, -torch.inf)[scored].float()
    teacher = torch.where(valid, teacher_logprobs.to(student.dtype), -torch.inf)[scored]
    kept = valid[scored]
    if add_tail_bucket:
        student, outcomes = with_tail_bucket(student, kept)
        teacher, _ = with_tail_bucket(teacher, kept)
    else:
        student = student - torch.logsumexp(student, dim=-1, keepdim=True)
        teacher = teacher - torch.logsumexp(teacher, dim=-1, keepdim=True)
        outcomes = kept
    terms = generalized_jsd(student, teacher, outcomes, beta)
    zero = torch.zeros_like(teacher)
    teacher_entropy = torch.nan_to_num(
        -(torch.where(outcomes, teacher.exp(), zero) * torch.where(outcomes, teacher, zero)).sum(-1), nan=0.0
    )
    jsd = student_logprobs.new_zeros(scored.shape, dtype=terms.dtype)
    entropy = jsd.detach().clone()
    return Divergence(
        jsd.index_put((scored,), terms.sum(-1)), entropy.index_put((scored,), teacher_entropy), scored
    )
