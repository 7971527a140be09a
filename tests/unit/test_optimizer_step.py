"""The optimizer step queued on the device (trainer/optimizer_step.py) against clip_grad_norm_ + step:
same update, and a non-finite loss or gradient leaves weights and optimizer states untouched; the
Triton AdamW (adamw_kernel.py) against torch's AdamW, and when the trainer uses it."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from interpreted import run_interpreted

from asyncgrpo.trainer.optimizer_step import queue_clipped_step, takes_device_decisions, with_triton_update


def model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)


def backward(model, scale: float = 1.0):
    torch.manual_seed(1)
    loss = (model(torch.randn(4, 6)) ** 2).sum() * scale
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("max_norm", [0.01, 1e9, math.inf])
def test_queued_step_equals_clip_then_step(max_norm):
    reference, reference_optimizer = model_and_optimizer()
    model, optimizer = model_and_optimizer()
    assert takes_device_decisions(optimizer)
    for _ in range(3):  # several steps: AdamW's moments and step count must agree too
        backward(reference)
        expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        loss = backward(model)
        norm, skipped = queue_clipped_step(optimizer, list(model.parameters()), max_norm, loss)
        optimizer.zero_grad()
        assert not bool(skipped)
        torch.testing.assert_close(norm, expected_norm)
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")


@pytest.mark.parametrize("bad", ["loss", "gradient"])
def test_a_non_finite_step_changes_nothing(bad):
    model, optimizer = model_and_optimizer()
    queue_clipped_step(optimizer, list(model.parameters()), 1.0, backward(model))  # one good step
    optimizer.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in optimizer.state[next(model.parameters())].items()}
    loss = backward(model)
    if bad == "loss":
        loss = torch.tensor(float("nan"))
    else:
        next(model.parameters()).grad[0, 0] = float("inf")
    norm, skipped = queue_clipped_step(optimizer, list(model.parameters()), 1.0, loss)
    assert bool(skipped)
    assert (bad == "gradient") == (not math.isfinite(float(norm)))
    for got, want in zip(model.parameters(), before):
        assert torch.equal(got, want)
    for name, value in optimizer.state[next(model.parameters())].items():
        assert torch.equal(value, state[name]), name


def test_optimizers_without_device_decisions_are_recognized():
    model = torch.nn.Linear(2, 2)
    assert not takes_device_decisions(torch.optim.AdamW(model.parameters(), foreach=False))
    assert not takes_device_decisions(torch.optim.SGD(model.parameters()))


def test_accelerates_wrapper_takes_the_device_path():
    """The trainer's optimizer is accelerate's AcceleratedOptimizer: the attributes must reach the
    torch optimizer inside it, and the update must still be clip-then-step."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    reference, reference_optimizer = model_and_optimizer()
    model, optimizer = model_and_optimizer()
    wrapped = Accelerator(cpu=True).prepare_optimizer(optimizer, device_placement=False)
    assert isinstance(wrapped, AcceleratedOptimizer)
    assert takes_device_decisions(wrapped)
    backward(reference)
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
    reference_optimizer.step()
    norm, skipped = queue_clipped_step(wrapped, list(model.parameters()), 0.01, backward(model))
    assert not bool(skipped)
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not hasattr(optimizer, "grad_scale")


@pytest.mark.slow
def test_triton_adamw_matches_torch_adamw_in_tritons_interpreter():
    """The Triton update's logic on every CPU run, through Triton's interpreter: the same checks as
    the GPU test below, what the kernel does not cover (amsgrad, FSDP2's sharded parameters) left to
    torch's update, and the class the trainer would pick on a GPU."""
    lines = run_interpreted("adamw_kernel_check.py").splitlines()
    assert lines[-4:] == ["ok cpu", "amsgrad: torch's update", "sharded: torch's step", "picked on cuda"]


@pytest.mark.gpu
def test_cuda_triton_adamw_matches_torch_adamw():
    from adamw_kernel_check import check_triton_adamw

    check_triton_adamw("cuda")


def test_only_torchs_fused_adamw_on_cuda_is_replaced():
    """CPU, another optimizer, a non-fused AdamW or triton_adamw=False keep what Trainer picked."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    kept = [
        (torch.optim.AdamW, {"fused": True}, SimpleNamespace(device=cpu, triton_adamw=True)),
        (torch.optim.AdamW, {"fused": True}, SimpleNamespace(device=cuda, triton_adamw=False)),
        (torch.optim.AdamW, {"foreach": True}, SimpleNamespace(device=cuda, triton_adamw=True)),
        (torch.optim.SGD, {"fused": True}, SimpleNamespace(device=cuda, triton_adamw=True)),
    ]
    for optimizer_cls, kwargs, args in kept:
        assert with_triton_update(optimizer_cls, kwargs, args) is optimizer_cls
