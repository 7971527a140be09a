"""A Triton AdamW update (CUDA only): one read and one write of each fp32 parameter and state.

`TritonAdamW` is torch's AdamW (same arguments, state and checkpoints) whose step runs this kernel.
The optimizer step is the part of a training step that packing cannot shrink, and torch's fused
update runs below the card's memory bandwidth; this one does nothing per element but the update's
arithmetic. Why and how fast: docs/gpu-performance.md, "AdamW at memory bandwidth".
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.optim.adam import adam as torch_adam_update

# Elements and warps per program: the fastest on an H200 of the settings bench/adamw_step.py sweeps
# (bench/RESULTS.md, gpu_step, fourth round).
BLOCK, WARPS = 1024, 16


# The update, per element, is torch's AdamW (decoupled weight decay):
#     g = grad / grad_scale                  (the clipping factor, a device scalar: no host read)
#     p <- p (1 - lr wd)
#     m <- b1 m + (1 - b1) g,   v <- b2 v + (1 - b2) g^2
#     p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
# and nothing at all when `found_inf` is set (a non-finite step is skipped on the device). The bias
# corrections are computed once per step for every tensor (their step counts may differ) in float64.
@triton.jit
def _adamw_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, numel,
    corrections_ptr, index, grad_scale_ptr, found_inf_ptr,
    decay_factor, beta1, beta2, eps,
    BLOCK: tl.constexpr,
):  # fmt: skip
    if tl.load(found_inf_ptr) == 0:
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < numel
        grad = tl.load(grad_ptr + offsets, mask=inside, other=0.0) / tl.load(grad_scale_ptr)
        param = tl.load(param_ptr + offsets, mask=inside, other=0.0) * decay_factor
        exp_avg = beta1 * tl.load(exp_avg_ptr + offsets, mask=inside, other=0.0) + (1.0 - beta1) * grad
        exp_avg_sq = (
            beta2 * tl.load(exp_avg_sq_ptr + offsets, mask=inside, other=0.0) + (1.0 - beta2) * grad * grad
        )
        step_size = tl.load(corrections_ptr + 2 * index)
        root_correction = tl.load(corrections_ptr + 2 * index + 1)
        param -= step_size * exp_avg / (tl.sqrt(exp_avg_sq) / root_correction + eps)
        tl.store(param_ptr + offsets, param, mask=inside)
        tl.store(exp_avg_ptr + offsets, exp_avg, mask=inside)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=inside)


def bias_corrections(steps: list[torch.Tensor], lr: float, beta1: float, beta2: float) -> torch.Tensor:
    """(tensors, 2) fp32: lr / (1 - b1^t) and sqrt(1 - b2^t) for each tensor's step count t (already
    counting this step), computed in float64 on the device (1 - b2^t is ~1e-3 at t = 1)."""
    t = torch.stack(steps).double()
    step_size = lr / (1.0 - torch.pow(beta1, t))
    root_correction = torch.sqrt(1.0 - torch.pow(beta2, t))
    return torch.stack([step_size, root_correction], dim=1).float()


def adamw_update_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: torch.Tensor,
    found_inf: torch.Tensor,
    block: int = BLOCK,
    warps: int = WARPS,
) -> None:
    """Update contiguous fp32 `params` and their moments in place, one launch per tensor. `steps`
    already count this step; `grad_scale` (fp32, 1 element) divides the gradients, `found_inf`
    (fp32, 1 element, 0 or 1) skips the whole update when 1. Nothing here waits for the device."""
    corrections = bias_corrections(steps, lr, beta1, beta2)
    decay_factor = 1.0 - lr * weight_decay
    for index, (param, grad, exp_avg, exp_avg_sq) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        numel = param.numel()
        _adamw_kernel[(triton.cdiv(numel, block),)](
            param, grad, exp_avg, exp_avg_sq, numel,
            corrections, index, grad_scale, found_inf,
            decay_factor, beta1, beta2, eps,
            BLOCK=block, num_warps=warps,
        )  # fmt: skip


class TritonAdamW(torch.optim.AdamW):
    """torch's fused AdamW (same arguments, state and checkpoints) whose step runs `adamw_update_` for
    each parameter group the kernel covers: plain, contiguous fp32 CUDA parameters with dense fp32
    gradients, no amsgrad or maximize, float hyperparameters. Other groups take the update torch's
    fused AdamW step makes (`torch.optim.adam.adam`), not `super().step()`, so optimizer step hooks
    run once. Honours `grad_scale` and `found_inf` as torch's fused step does (optimizer_step.py)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **{**kwargs, "fused": True})  # torch refuses fused + differentiable
        self._one, self._zero = {}, {}

    @staticmethod
    def _kernel_covers(group: dict) -> bool:
        if group["amsgrad"] or group["maximize"] or not group["decoupled_weight_decay"]:
            return False
        if any(isinstance(value, torch.Tensor) for value in (group["lr"], *group["betas"])):
            return False
        # Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) runs kernels on CPU tensors
        device_type = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
        for param in group["params"]:
            plain = type(param.data) is torch.Tensor  # not a DTensor shard (FSDP2)
            if not (plain and param.device.type == device_type and param.dtype == torch.float32):
                return False
            grad = param.grad
            tensors = (param,) if grad is None else (param, grad)
            if any(t.is_sparse or t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
                return False
        return True

    def _constant(self, cache: dict, value: float, device: torch.device) -> torch.Tensor:
        if device not in cache:
            cache[device] = torch.full((1,), value, dtype=torch.float32, device=device)
        return cache[device]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
            has_complex = self._init_group(
                group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps
            )
            if not params:
                continue
            beta1, beta2 = group["betas"]
            if not self._kernel_covers(group):
                torch_adam_update(
                    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, fused=True,
                    grad_scale=grad_scale, found_inf=found_inf, has_complex=has_complex,
                    decoupled_weight_decay=group["decoupled_weight_decay"], amsgrad=group["amsgrad"],
                    beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                    eps=group["eps"], maximize=group["maximize"],
                )  # fmt: skip
                continue
            device = params[0].device
            scale = self._constant(self._one, 1.0, device) if grad_scale is None else grad_scale.reshape(1)
            skip = self._constant(self._zero, 0.0, device) if found_inf is None else found_inf.reshape(1)
            torch._foreach_add_(steps, 1)
            adamw_update_(
                params, grads, exp_avgs, exp_avg_sqs, steps, lr=group["lr"], beta1=beta1, beta2=beta2,
                eps=group["eps"], weight_decay=group["weight_decay"], grad_scale=scale, found_inf=skip,
            )  # fmt: skip
            if found_inf is not None:
                torch._foreach_sub_(steps, [found_inf.reshape(())] * len(steps))
        return loss
