"""The distillation loss (asyncgrpo/losses/distillation.py) on values worked out by hand: the support per
beta, the tail bucket, the generalized JSD at beta 0, 1 and between, entries the teacher did not score."""

from __future__ import annotations

import math

import torch

from asyncgrpo.losses.distillation import (
    distillation_divergence,
    generalized_jsd,
    teacher_support,
    with_tail_bucket,
)

L = math.log
# Two entries; the teacher reported 3 ids for the first (ranks 0, 1, then the realized 9 outside its top-2)
# and 2 for the second, whose realized token 4 is its top-1.
IDS = torch.tensor([[5, 7, 9], [4, 2, -1]])
LOGPROBS = torch.tensor([[L(0.6), L(0.3), L(0.01)], [L(0.7), L(0.2), -math.inf]])
TARGETS = torch.tensor([9, 4])


def test_the_support_is_the_reported_ids_at_beta_0():
    ids, logprobs, valid = teacher_support(IDS, LOGPROBS, TARGETS, beta=0.0)
    assert torch.equal(ids, IDS) and torch.equal(logprobs, LOGPROBS)
    assert valid.tolist() == [[True, True, True], [True, True, False]]


def test_the_support_is_the_realized_token_at_beta_1():
    ids, logprobs, valid = teacher_support(IDS, LOGPROBS, TARGETS, beta=1.0)
    assert ids.tolist() == [[9], [4]]
    assert torch.allclose(logprobs, torch.tensor([[L(0.01)], [L(0.7)]]))
    assert valid.tolist() == [[True], [True]]


def test_between_the_support_is_the_top1_and_the_realized_token_counted_once():
    ids, logprobs, valid = teacher_support(IDS, LOGPROBS, TARGETS, beta=0.5)
    assert ids.tolist() == [[5, 9], [4, 4]]
    assert torch.allclose(logprobs, torch.tensor([[L(0.6), L(0.01)], [L(0.7), L(0.7)]]))
    assert valid.tolist() == [[True, True], [True, False]]  # the second entry's realized token is its top-1


def test_a_realized_token_the_teacher_did_not_report_is_not_in_the_support():
    ids, logprobs, valid = teacher_support(IDS, LOGPROBS, torch.tensor([8, 4]), beta=1.0)
    assert valid.tolist() == [[False], [True]] and logprobs[0, 0] == -math.inf


def test_the_tail_bucket_holds_the_mass_outside_the_support():
    logprobs = torch.tensor([[L(0.5), L(0.25), -math.inf]])
    with_tail, valid = with_tail_bucket(logprobs, torch.tensor([[True, True, False]]))
    assert torch.allclose(with_tail.exp(), torch.tensor([[0.5, 0.25, 0.0, 0.25]]))
    assert valid.tolist() == [[True, True, False, True]]
    # A support holding all the mass leaves a tiny tail, never log 0.
    full, _ = with_tail_bucket(torch.tensor([[L(0.5), L(0.5)]]), torch.tensor([[True, True]]))
    assert math.isfinite(full[0, 2].item()) and full[0, 2].exp() < 1e-6


def test_generalized_jsd_is_forward_kl_reverse_kl_and_the_mixture_between():
    student = torch.tensor([[L(0.5), L(0.5)]])
    teacher = torch.tensor([[L(0.75), L(0.25)]])
    valid = torch.ones(1, 2, dtype=torch.bool)

    def jsd(beta):
        return generalized_jsd(student, teacher, valid, beta).sum().item()

    assert math.isclose(jsd(0.0), 0.75 * L(0.75 / 0.5) + 0.25 * L(0.25 / 0.5), rel_tol=1e-6)
    assert math.isclose(jsd(1.0), 0.5 * L(0.5 / 0.75) + 0.5 * L(0.5 / 0.25), rel_tol=1e-6)
    m = (0.625, 0.375)  # 0.5 x student + 0.5 x teacher
    to_teacher = 0.75 * L(0.75 / m[0]) + 0.25 * L(0.25 / m[1])
    to_student = 0.5 * L(0.5 / m[0]) + 0.5 * L(0.5 / m[1])
    assert math.isclose(jsd(0.5), 0.5 * to_teacher + 0.5 * to_student, rel_tol=1e-6)
    assert generalized_jsd(student, student, valid, 0.5).abs().max() < 1e-7


def test_the_divergence_with_and_without_the_tail_bucket():
    student = torch.tensor([[L(0.5)]], requires_grad=True)
    teacher = torch.tensor([[L(0.8)]])
    valid = torch.tensor([[True]])
    # With the tail: S = (0.5, 0.5), T = (0.8, 0.2) over (the token, the rest).
    out = distillation_divergence(student, teacher, valid, beta=0.0)
    assert math.isclose(out.jsd.item(), 0.8 * L(0.8 / 0.5) + 0.2 * L(0.2 / 0.5), rel_tol=1e-6)
    assert math.isclose(out.teacher_entropy.item(), -(0.8 * L(0.8) + 0.2 * L(0.2)), rel_tol=1e-6)
    # d/ds of 0.8 (log 0.8 - s) + 0.2 (log 0.2 - log(1 - e^s)) at s = log 0.5: -0.8 + 0.2 x 0.5 / 0.5.
    out.jsd.sum().backward()
    assert math.isclose(student.grad.item(), -0.8 + 0.2, rel_tol=1e-5)
    # Without it, both sides renormalize over one id: the same distribution, no divergence.
    assert distillation_divergence(student, teacher, valid, 0.0, add_tail_bucket=False).jsd.item() == 0.0


def test_an_entry_the_teacher_did_not_score_adds_nothing_and_no_nan_gradient():
    student = torch.tensor([[L(0.5), L(0.2)], [L(0.1), L(0.1)]], requires_grad=True)
    teacher = torch.tensor([[L(0.6), L(0.3)], [-math.inf, -math.inf]])
    valid = torch.tensor([[True, True], [False, False]])
    for beta in (0.0, 0.5, 1.0):
        out = distillation_divergence(student, teacher, valid, beta)
        assert out.scored.tolist() == [True, False]
        assert out.jsd[1] == 0.0 and out.teacher_entropy[1] == 0.0 and out.jsd[0] > 0
        (grad,) = torch.autograd.grad(out.jsd.sum(), student)
        assert torch.isfinite(grad).all() and torch.equal(grad[1], torch.zeros(2))
