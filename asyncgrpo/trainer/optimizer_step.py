"""Clipping and the optimizer step queued on the device, with no wait for the host in between.

Clipping needs the gradient norm, and skipping a non-finite step needs to know the loss and the norm
are finite. Read on the host, each is a synchronization: the GPU then idles while Python clips,
checks and walks the optimizer's parameter groups (for how long: docs/gpu-performance.md). Optimizers
that support AMP's gradient scaling (torch's fused Adam, AdamW and SGD: `_step_supports_amp_scaling`)
take both decisions on the device instead: `grad_scale` divides the gradients inside the update
kernel (clipping by max_norm / norm is dividing by norm / max_norm) and `found_inf` makes the kernel
leave parameters and states untouched. The host reads the norm and whether the step was skipped
afterwards, once the whole step is queued.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch

from asyncgrpo.trainer.row_loss import QueuedRows
from asyncgrpo.trainer.step_metrics import StepResult

CLIP_EPSILON = 1e-6  # torch.nn.utils.clip_grad_norm_'s: max_norm / (norm + 1e-6)


def torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside `optimizer`: accelerate's AcceleratedOptimizer keeps it as
    `.optimizer` and forwards `step()` to it, but not the attributes read and set here."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def takes_device_decisions(optimizer) -> bool:
    """Whether `optimizer.step()` honours `grad_scale` and `found_inf` (see the module doc). Not
    under fp16 loss scaling: accelerate's GradScaler sets those attributes itself."""
    if getattr(optimizer, "scaler", None) is not None:
        return False
    return bool(getattr(torch_optimizer(optimizer), "_step_supports_amp_scaling", False))


def queue_clipped_step(
    optimizer, parameters: list[torch.nn.Parameter], max_norm: float, loss: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip the gradients to `max_norm` (inf: measure only) and step, skipping the update when the
    loss or the gradient norm is not finite. Returns (gradient norm, skipped) as 0-d device tensors;
    nothing here waits for the device."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    skipped = ~(torch.isfinite(norm) & torch.isfinite(loss.to(norm.device)))
    scale = torch.ones_like(norm)
    if math.isfinite(max_norm):
        scale = torch.clamp((norm + CLIP_EPSILON) / max_norm, min=1.0)
    inner = torch_optimizer(optimizer)
    inner.grad_scale = scale
    inner.found_inf = skipped.float()
    try:
        optimizer.step()  # a wrapper's step: accelerate's bookkeeping runs too
    finally:
        del inner.grad_scale, inner.found_inf
    return norm, skipped


def max_grad_norm(setting: float | None) -> float:
    """The clipping bound of `max_grad_norm`: inf (measure only) when unset or not positive."""
    return setting if setting and setting > 0 else math.inf


def host_decided_step(
    optimizer,
    clip: Callable[[float], float],
    max_norm: float,
    result: StepResult,
    before_step: Callable[[], None],
    device: torch.device,
) -> StepResult:
    """Clip (`clip(max_norm)` -> the gradient norm) and step deciding on the host (several processes,
    or an optimizer that cannot decide on the device), the rows already read into `result`."""
    started = _now(device)
    result.grad_norm = clip(max_norm)
    # Both are global: every rank agrees.
    result.stepped = math.isfinite(result.loss) and math.isfinite(result.grad_norm)
    if result.stepped:
        before_step()
        optimizer.step()
    result.optimizer_s = _now(device) - started
    return result


def device_decided_step(
    optimizer,
    parameters: list[torch.nn.Parameter],
    max_norm: float,
    queued: QueuedRows,
    read_rows: Callable[[QueuedRows], StepResult],
    before_step: Callable[[], None],
) -> StepResult:
    """Clipping and the finiteness check queued on the device behind the last backward
    (`queue_clipped_step`); the host reads the step's values once, at the end (`read_rows`)."""
    clock = queued.clock
    started = clock.mark()
    loss = torch.stack(queued.losses).sum() if queued.losses else torch.zeros(())
    before_step()
    grad_norm, skipped = queue_clipped_step(optimizer, parameters, max_norm, loss)
    done = clock.mark()
    result = read_rows(queued)
    result.grad_norm, result.stepped = float(grad_norm), not bool(skipped)
    result.optimizer_s = clock.seconds(started, done)
    return result


def _now(device: torch.device) -> float:
    if torch.cuda.is_available() and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def with_triton_update(optimizer_cls: type, kwargs: dict, args) -> type:
    """The optimizer class to build in place of `optimizer_cls`: torch's fused AdamW (the default
    `optim`) becomes the Triton AdamW on a CUDA device unless `args.triton_adamw` is False. Same
    update, arguments, state and checkpoints; the update runs at memory bandwidth (adamw_kernel.py)."""
    fused_adamw = optimizer_cls is torch.optim.AdamW and kwargs.get("fused")
    if not (fused_adamw and getattr(args, "triton_adamw", True) and args.device.type == "cuda"):
        return optimizer_cls
    from asyncgrpo.kernels.adamw_kernel import TritonAdamW  # imports Triton, which CPU-only installs lack

    return TritonAdamW
