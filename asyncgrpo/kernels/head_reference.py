"""The fused head's two passes in plain torch: the CPU path, and the reference the Triton kernels
(`head_kernels`) are tested against; `fused_head` says what they compute."""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def widened(raw: torch.Tensor) -> torch.Tensor:
    return raw.to(torch.promote_types(raw.dtype, torch.float32))


def transform_logits(
    raw: torch.Tensor, scale: float, softcap: float | None, temperature: float
) -> torch.Tensor:
    """raw head output (C, V) -> the logits the sampler's softmax reads, in fp32 at least."""
    logits = widened(raw)
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits / temperature


def chunk_forward(raw, targets, top_ids, allowed, scale: float, softcap, temperature: float):
    """(C, V) head output -> log p(target) (C,), entropy (C,), top log p (C, N) or None, lse (C,)."""
    z = transform_logits(raw, scale, softcap, temperature)
    if allowed is not None:
        z = z.masked_fill(~allowed, NEG_INF)
    lse = torch.logsumexp(z, dim=-1)
    p = torch.exp(z - lse[:, None])
    finite_z = z if allowed is None else z.masked_fill(~allowed, 0.0)  # p = 0 there: 0 * -inf is NaN
    entropy = lse - (p * finite_z).sum(-1)
    target_logp = z.gather(1, targets[:, None])[:, 0] - lse
    top_logp = None
    if top_ids is not None:
        top_logp = (z.gather(1, top_ids.clamp(min=0)) - lse[:, None]).masked_fill(top_ids < 0, NEG_INF)
    return target_logp, entropy, top_logp, lse


# With z the transformed logits (scale, softcap, / temperature, candidate mask), y_t = log p_t (the
# target and top-N ids) and H = -sum_v p_v log p_v:
#     d y_t / d z_v = [v = t] - p_v,     d H / d z_v = -p_v (log p_v + H).
def chunk_backward(raw, lse, entropy, targets, top_ids, allowed, g_target, g_entropy, g_top,
                    scale: float, softcap, temperature: float, out_dtype: torch.dtype, out=None):  # fmt: skip
    """d loss / d raw head output (C, V) in `out_dtype`, from the gradients of the three outputs;
    written into `out` when given (it may be `raw` itself)."""
    z = transform_logits(raw, scale, softcap, temperature)
    if allowed is not None:
        z = z.masked_fill(~allowed, NEG_INF)
    logp = z - lse[:, None]
    p = torch.exp(logp)
    total = g_target if g_top is None else g_target + g_top.masked_fill(top_ids < 0, 0.0).sum(-1)
    grad = -p * total[:, None]
    if g_entropy is not None:
        finite_logp = logp if allowed is None else logp.masked_fill(~allowed, 0.0)
        grad = grad - p * (finite_logp + entropy[:, None]) * g_entropy[:, None]
    grad = grad.scatter_add(1, targets[:, None], g_target[:, None])
    if g_top is not None:
        grad = grad.scatter_add(1, top_ids.clamp(min=0), g_top.masked_fill(top_ids < 0, 0.0))
    if allowed is not None:  # the unfused path's masked_fill passes no gradient to masked logits
        grad = grad.masked_fill(~allowed, 0.0)
    grad = grad / temperature
    if softcap is not None:
        capped = torch.tanh(widened(raw) * (scale / softcap))
        grad = grad * (1.0 - capped * capped)
    if scale != 1.0:
        grad = grad * scale
    return grad.to(out_dtype) if out is None else out.copy_(grad)
