"""Triton kernels for the fused head's two passes over the (C, V) head output (CUDA only).

`fused_head` reduces each entry's V logits to log-normalizer and entropy (forward) and builds
d loss / d logits (backward). Written as torch ops, even compiled, the forward read the bf16 logits
about three times (max, sum of exponentials, the entropy's sum) and the backward wrote a full fp32
gradient before its scatters and its cast: on an H200 these passes, not the head's matmuls, were the
part of a training step that packing could not shrink (bench/RESULTS.md, gpu_step). Here:
- forward: one read of each row, with running maxima, sums of exp(z - m) and of exp(z - m) z kept
  per lane and combined at the end (the online log-sum-exp);
- backward: one read and one write of each element, target and top-N terms added in the same pass,
  written in the head's dtype, in place over the logits when the caller no longer needs them.
Same formulas as `fused_head._chunk_forward` / `_chunk_backward` (the reference, tests/test_fused_head.py):
with z the transformed logits, p = exp(z - lse), H = lse - sum_v p_v z_v and
    d loss / d z_v = -p_v (sum of the log-prob gradients + g_H (log p_v + H)) + [v = t] g_t + ...
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncgrpo.fused_head import transform_logits

NEG_INF = float("-inf")
_KERNEL_NEG_INF = tl.constexpr(NEG_INF)  # a kernel reads globals only as constexpr
# Columns per program and warps per program. Forward: one program walks a whole row (V / 2,048 steps
# of 4 KB of bf16); backward: one program per (row, block) pair, 75 for a row of 152k logits. The
# fastest of 12 choices each on an H200 (bench/fused_head_passes.py, bench/RESULTS.md).
STATS_BLOCK, STATS_WARPS = 2048, 8
GRAD_BLOCK, GRAD_WARPS = 2048, 8


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1): +-1 in the limits, no inf / inf
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _stats_kernel(raw_ptr, allowed_ptr, lse_ptr, entropy_ptr, vocab, raw_stride, allowed_stride,
                  scale, softcap, temperature,
                  HAS_SOFTCAP: tl.constexpr, HAS_ALLOWED: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    running_max = tl.full((BLOCK,), _KERNEL_NEG_INF, tl.float32)
    exp_sum = tl.zeros((BLOCK,), tl.float32)  # sum exp(z - running_max), per lane
    weighted_sum = tl.zeros((BLOCK,), tl.float32)  # sum exp(z - running_max) z, per lane
    for start in range(0, vocab, BLOCK):
        cols = start + lanes
        valid = cols < vocab
        z = tl.load(raw_ptr + row * raw_stride + cols, mask=valid, other=0.0).to(tl.float32) * scale
        if HAS_SOFTCAP:
            z = _tanh(z / softcap) * softcap
        z = z / temperature
        if HAS_ALLOWED:
            valid = valid & (tl.load(allowed_ptr + row * allowed_stride + cols, mask=valid, other=0) != 0)
        z = tl.where(valid, z, _KERNEL_NEG_INF)
        new_max = tl.maximum(running_max, z)
        seen = new_max > _KERNEL_NEG_INF  # a lane that has seen no allowed logit keeps zero sums
        rescale = tl.where(seen, tl.exp(running_max - new_max), 0.0)
        weight = tl.where(valid, tl.exp(z - new_max), 0.0)
        exp_sum = exp_sum * rescale + weight
        weighted_sum = weighted_sum * rescale + weight * tl.where(valid, z, 0.0)
        running_max = new_max
    row_max = tl.max(running_max, 0)
    lane_scale = tl.where(running_max > _KERNEL_NEG_INF, tl.exp(running_max - row_max), 0.0)
    total = tl.sum(exp_sum * lane_scale, 0)
    lse = row_max + tl.log(total)
    tl.store(lse_ptr + row, lse)
    tl.store(entropy_ptr + row, lse - tl.sum(weighted_sum * lane_scale, 0) / total)


@triton.jit
def _grad_kernel(raw_ptr, out_ptr, allowed_ptr, lse_ptr, entropy_ptr, logp_grad_sum_ptr, entropy_grad_ptr,
                 targets_ptr, target_grad_ptr, top_ids_ptr, top_grad_ptr,
                 vocab, raw_stride, out_stride, allowed_stride, top_stride,
                 scale, softcap, temperature,
                 HAS_SOFTCAP: tl.constexpr, HAS_ALLOWED: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr,
                 NUM_TOP: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < vocab
    scaled = tl.load(raw_ptr + row * raw_stride + cols, mask=valid, other=0.0).to(tl.float32) * scale
    if HAS_SOFTCAP:
        capped = _tanh(scaled / softcap)
        z = capped * softcap / temperature
    else:
        z = scaled / temperature
    logp = z - tl.load(lse_ptr + row)
    p = tl.exp(logp)
    grad = -p * tl.load(logp_grad_sum_ptr + row)
    if HAS_ENTROPY_GRAD:
        grad -= p * (logp + tl.load(entropy_ptr + row)) * tl.load(entropy_grad_ptr + row)
    grad += tl.where(cols == tl.load(targets_ptr + row), tl.load(target_grad_ptr + row), 0.0)
    for j in tl.static_range(NUM_TOP):  # top ids of -1 (padding) match no column
        top = tl.load(top_ids_ptr + row * top_stride + j)
        grad += tl.where(cols == top, tl.load(top_grad_ptr + row * top_stride + j), 0.0)
    if HAS_ALLOWED:  # a logit outside the candidate set gets no gradient
        allowed = tl.load(allowed_ptr + row * allowed_stride + cols, mask=valid, other=0) != 0
        grad = tl.where(allowed, grad, 0.0)
    grad = grad / temperature
    if HAS_SOFTCAP:
        grad = grad * (1.0 - capped * capped)
    grad = grad * scale
    tl.store(out_ptr + row * out_stride + cols, grad.to(out_ptr.dtype.element_ty), mask=valid)


def _softcap_args(softcap: float | None) -> tuple[float, bool]:
    return (1.0, False) if softcap is None else (float(softcap), True)


def chunk_forward(raw, targets, top_ids, allowed, scale: float, softcap, temperature: float):
    """As `fused_head._chunk_forward`: (C, V) head output -> log p(target) (C,), entropy (C,),
    top log p (C, N) or None, lse (C,)."""
    rows, vocab = raw.shape
    raw = raw.contiguous()
    lse = torch.empty(rows, dtype=torch.float32, device=raw.device)
    entropy = torch.empty_like(lse)
    cap, has_softcap = _softcap_args(softcap)
    if rows:
        _stats_kernel[(rows,)](
            raw, raw if allowed is None else allowed, lse, entropy, vocab, raw.stride(0),
            0 if allowed is None else allowed.stride(0), float(scale), cap, float(temperature),
            HAS_SOFTCAP=has_softcap, HAS_ALLOWED=allowed is not None, BLOCK=STATS_BLOCK,
            num_warps=STATS_WARPS,
        )  # fmt: skip

    def logp_at(ids: torch.Tensor) -> torch.Tensor:  # (C, K) ids -> log p there (-inf outside the set)
        z = transform_logits(raw.gather(1, ids), scale, softcap, temperature) - lse[:, None]
        return z if allowed is None else z.masked_fill(~allowed.gather(1, ids), NEG_INF)

    target_logp = logp_at(targets[:, None])[:, 0]
    top_logp = None
    if top_ids is not None:
        top_logp = logp_at(top_ids.clamp(min=0)).masked_fill(top_ids < 0, NEG_INF)
    return target_logp, entropy, top_logp, lse


def chunk_backward(raw, lse, entropy, targets, top_ids, allowed, g_target, g_entropy, g_top,
                   scale: float, softcap, temperature: float, out_dtype: torch.dtype, out=None):  # fmt: skip
    """As `fused_head._chunk_backward`: d loss / d raw head output (C, V) in `out_dtype`. `out`: where
    to write it, which may be `raw` itself (each element is read before it is written)."""
    rows, vocab = raw.shape
    raw = raw.contiguous()
    if out is None:
        out = torch.empty(rows, vocab, dtype=out_dtype, device=raw.device)
    g_target = g_target.float().contiguous()
    logp_grad_sum = g_target
    if g_top is None:  # top log-probs the loss does not read (the clipped loss): no terms at all
        top_ids = None
    else:
        g_top = g_top.float().masked_fill(top_ids < 0, 0.0).contiguous()
        logp_grad_sum = g_target + g_top.sum(-1)
    cap, has_softcap = _softcap_args(softcap)
    if rows:
        _grad_kernel[(rows, triton.cdiv(vocab, GRAD_BLOCK))](
            raw, out, raw if allowed is None else allowed, lse, entropy, logp_grad_sum,
            g_target if g_entropy is None else g_entropy.float().contiguous(), targets.contiguous(),
            g_target, targets if top_ids is None else top_ids.contiguous(),
            g_target if g_top is None else g_top,
            vocab, raw.stride(0), out.stride(0), 0 if allowed is None else allowed.stride(0),
            0 if top_ids is None else top_ids.shape[1], float(scale), cap, float(temperature),
            HAS_SOFTCAP=has_softcap, HAS_ALLOWED=allowed is not None, HAS_ENTROPY_GRAD=g_entropy is not None,
            NUM_TOP=0 if top_ids is None else top_ids.shape[1], BLOCK=GRAD_BLOCK, num_warps=GRAD_WARPS,
        )  # fmt: skip
    return out
