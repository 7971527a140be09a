"""Triton kernels for the fused head's two passes over the (C, V) head output (CUDA only).

Forward: one read of each row (an online log-sum-exp that also sums the entropy's terms). Backward:
one read and one write of each element, in the head's dtype, in place over the logits when the caller
no longer needs them; the few columns with a target or top-N term (at most 1 + N a row) are then
rewritten whole by the torch reference (`head_reference.chunk_backward`), so the pass over V columns
compares no ids. Both are kept cheap per element (base-2 exponentials, the backward's per-row terms
folded into two scalars) so that they run at memory bandwidth; the formulas and why:
docs/gpu-performance.md#the-fused-output-head.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from asyncgrpo.kernels import head_reference
from asyncgrpo.kernels.head_reference import NEG_INF, transform_logits

_LN2 = tl.constexpr(math.log(2.0))  # a kernel reads globals only as constexpr
# Logits outside the candidate set (or past the vocabulary) enter the forward sums as this finite
# base-2 value instead of -inf: exp2 of it against any real maximum is exactly 0, and a lane that has
# seen only such values is rescaled by exp2(-1e30 - real maximum) = 0 once a real one comes, so no
# inf - inf (NaN) ever arises. A row always has at least one allowed logit (an empty set = all).
_MASKED = tl.constexpr(-1.0e30)
# Columns and warps per program. Forward: one program walks a whole row (V / 1,024 steps); backward:
# one program per (row, block of 2,048 columns), the blocks of a row consecutive. The fastest on an
# H200 of the choices bench/fused_head_passes.py tries (bench/RESULTS.md, "gpu_step").
STATS_BLOCK, STATS_WARPS = 1024, 16
GRAD_BLOCK, GRAD_WARPS = 2048, 4


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1): +-1 in the limits, no inf / inf
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _log2_logits(raw, in_scale, out_scale, HAS_SOFTCAP: tl.constexpr):
    """raw head output -> (z / ln 2, tanh's value under a softcap, else the raw value as fp32).
    in_scale, out_scale: scale / temperature / ln 2 and unused, or scale / softcap and
    softcap / temperature / ln 2 under a softcap."""
    x = raw.to(tl.float32)
    if HAS_SOFTCAP:
        capped = _tanh(x * in_scale)
        return capped * out_scale, capped
    return x * in_scale, x


@triton.jit
def _stats_update(z2, row_max, exp_sum, weighted_sum):
    """One block of a row into the per-lane running maximum and sums."""
    new_max = tl.maximum(row_max, z2)
    rescale = tl.exp2(row_max - new_max)
    weight = tl.exp2(z2 - new_max)
    return new_max, exp_sum * rescale + weight, weighted_sum * rescale + weight * z2


@triton.jit
def _stats_kernel(raw_ptr, allowed_ptr, lse_ptr, entropy_ptr, vocab, raw_stride, allowed_stride,
                  in_scale, out_scale,
                  HAS_SOFTCAP: tl.constexpr, HAS_ALLOWED: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    raw_row = raw_ptr + row * raw_stride
    allowed_row = allowed_ptr + row * allowed_stride
    lanes = tl.arange(0, BLOCK)
    row_max = tl.full((BLOCK,), _MASKED, tl.float32)  # per lane
    exp_sum = tl.zeros((BLOCK,), tl.float32)  # sum of exp2(z2 - row_max), per lane
    weighted_sum = tl.zeros((BLOCK,), tl.float32)  # sum of exp2(z2 - row_max) z2, per lane
    whole = vocab - vocab % BLOCK
    for start in range(0, whole, BLOCK):  # whole blocks: no bounds mask
        z2, _ = _log2_logits(tl.load(raw_row + start + lanes), in_scale, out_scale, HAS_SOFTCAP)
        if HAS_ALLOWED:
            z2 = tl.where(tl.load(allowed_row + start + lanes) != 0, z2, _MASKED)
        row_max, exp_sum, weighted_sum = _stats_update(z2, row_max, exp_sum, weighted_sum)
    cols = whole + lanes
    valid = cols < vocab
    z2, _ = _log2_logits(tl.load(raw_row + cols, mask=valid, other=0.0), in_scale, out_scale, HAS_SOFTCAP)
    if HAS_ALLOWED:
        valid = valid & (tl.load(allowed_row + cols, mask=valid, other=0) != 0)
    z2 = tl.where(valid, z2, _MASKED)
    row_max, exp_sum, weighted_sum = _stats_update(z2, row_max, exp_sum, weighted_sum)
    peak = tl.max(row_max, 0)
    lane_scale = tl.exp2(row_max - peak)
    total = tl.sum(exp_sum * lane_scale, 0)
    weighted = tl.sum(weighted_sum * lane_scale, 0)
    lse2 = peak + tl.log2(total)
    tl.store(lse_ptr + row, lse2 * _LN2)
    tl.store(entropy_ptr + row, (lse2 - weighted / total) * _LN2)


@triton.jit
def _grad_kernel(raw_ptr, out_ptr, allowed_ptr, lse_ptr, entropy_ptr, logp_grad_sum_ptr, entropy_grad_ptr,
                 vocab, num_blocks, raw_stride, out_stride, allowed_stride, in_scale, out_scale, grad_scale,
                 HAS_SOFTCAP: tl.constexpr, HAS_ALLOWED: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    """The dense part p_v (k + j u_v) x d z / d raw of one block of a row, target and top-N terms
    left out: u = (z - lse) / ln 2, k = -(S + g_H H), j = -g_H ln 2, with S the sum of the log-prob
    outputs' gradients and g_H the entropy's."""
    program = tl.program_id(0)
    row = (program // num_blocks).to(tl.int64)
    cols = (program % num_blocks) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < vocab
    lse2 = tl.load(lse_ptr + row) / _LN2
    k = -tl.load(logp_grad_sum_ptr + row)
    j = 0.0
    if HAS_ENTROPY_GRAD:
        entropy_grad = tl.load(entropy_grad_ptr + row)
        k -= entropy_grad * tl.load(entropy_ptr + row)
        j = -entropy_grad * _LN2 * grad_scale
    k = k * grad_scale
    raw = tl.load(raw_ptr + row * raw_stride + cols, mask=valid, other=0.0)
    z2, capped = _log2_logits(raw, in_scale, out_scale, HAS_SOFTCAP)
    u = z2 - lse2
    grad = tl.exp2(u) * (k + j * u) if HAS_ENTROPY_GRAD else tl.exp2(u) * k
    if HAS_SOFTCAP:
        grad = grad * (1.0 - capped * capped)
    if HAS_ALLOWED:  # a logit outside the candidate set gets no gradient
        allowed = tl.load(allowed_ptr + row * allowed_stride + cols, mask=valid, other=0) != 0
        grad = tl.where(allowed, grad, 0.0)
    tl.store(out_ptr + row * out_stride + cols, grad.to(out_ptr.dtype.element_ty), mask=valid)


def _scales(scale: float, softcap, temperature: float) -> tuple[float, float, bool]:
    """(in_scale, out_scale, has_softcap) of `_log2_logits`."""
    if softcap is None:
        return scale / temperature / math.log(2.0), 1.0, False
    return scale / softcap, softcap / temperature / math.log(2.0), True


def chunk_forward(raw, targets, top_ids, allowed, scale: float, softcap, temperature: float):
    """As `head_reference.chunk_forward`: (C, V) head output -> log p(target) (C,), entropy (C,),
    top log p (C, N) or None, lse (C,)."""
    rows, vocab = raw.shape
    raw = raw.contiguous()
    lse = torch.empty(rows, dtype=torch.float32, device=raw.device)
    entropy = torch.empty_like(lse)
    in_scale, out_scale, has_softcap = _scales(scale, softcap, temperature)
    if rows:
        _stats_kernel[(rows,)](
            raw, raw if allowed is None else allowed, lse, entropy, vocab, raw.stride(0),
            0 if allowed is None else allowed.stride(0), in_scale, out_scale,
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
    """As `head_reference.chunk_backward`: d loss / d raw head output (C, V) in `out_dtype`. `out`: where
    to write it, which may be `raw` itself (each element is read before it is written)."""
    rows, vocab = raw.shape
    raw = raw.contiguous()
    if out is None:
        out = torch.empty(rows, vocab, dtype=out_dtype, device=raw.device)
    if g_top is None:  # top log-probs the loss does not read (the clipped loss): no terms at all
        top_ids = None
    # The columns with a target or top-N term: copied before the pass may overwrite them.
    ids = targets[:, None] if top_ids is None else torch.cat([targets[:, None], top_ids], 1)
    ids = torch.where(ids < 0, targets[:, None], ids)  # padding (-1): rewrite the target's column again
    first = (ids[:, :, None] == ids[:, None, :]).int().argmax(-1)  # each column's first place in ids
    raw_at = raw.gather(1, ids)
    allowed_at = None if allowed is None else allowed.gather(1, ids)
    g_target = g_target.float().contiguous()
    logp_grad_sum = g_target
    if top_ids is not None:
        logp_grad_sum = g_target + g_top.float().masked_fill(top_ids < 0, 0.0).sum(-1)
    in_scale, out_scale, has_softcap = _scales(scale, softcap, temperature)
    if rows:
        num_blocks = triton.cdiv(vocab, GRAD_BLOCK)
        _grad_kernel[(rows * num_blocks,)](
            raw, out, raw if allowed is None else allowed, lse, entropy, logp_grad_sum,
            g_target if g_entropy is None else g_entropy.float().contiguous(),
            vocab, num_blocks, raw.stride(0), out.stride(0), 0 if allowed is None else allowed.stride(0),
            in_scale, out_scale, scale / temperature,
            HAS_SOFTCAP=has_softcap, HAS_ALLOWED=allowed is not None, HAS_ENTROPY_GRAD=g_entropy is not None,
            BLOCK=GRAD_BLOCK, num_warps=GRAD_WARPS,
        )  # fmt: skip
    # The id columns whole (dense part + every term landing there), by the reference over (C, 1 + N).
    local_top = None if top_ids is None else torch.where(top_ids < 0, -1, first[:, 1:])
    at_ids = head_reference.chunk_backward(
        raw_at, lse, entropy, first[:, 0], local_top, allowed_at, g_target, g_entropy, g_top,
        scale, softcap, temperature, torch.float32,
    )  # fmt: skip
    return out.scatter_(1, ids, at_ids.gather(1, first).to(out.dtype))
