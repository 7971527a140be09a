"""The output head, log-softmax, top-N gather and entropy as one autograd function (CUDA training).

Per chunk of trained entries, forward runs the head's matmul once and one pass that reduces the
logits to what the loss reads (log p(target), entropy, log p at the sampler's top-N ids, the
log-normalizer); backward rebuilds d loss / d logits in closed form in one more pass, in place over
the logits, and runs the two gradient matmuls. `keep_logits` keeps the head output for backward
instead of recomputing it. On CUDA the passes are Triton kernels (`head_kernels`); elsewhere they are
the torch functions below, which are also their reference (tests/test_fused_head.py). Why, and the
formulas: docs/gpu-performance.md#the-fused-output-head.
"""

from __future__ import annotations

import functools

import torch

NEG_INF = float("-inf")


def _widened(raw: torch.Tensor) -> torch.Tensor:
    return raw.to(torch.promote_types(raw.dtype, torch.float32))


def transform_logits(
    raw: torch.Tensor, scale: float, softcap: float | None, temperature: float
) -> torch.Tensor:
    """raw head output (C, V) -> the logits the sampler's softmax reads, in fp32 at least."""
    logits = _widened(raw)
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits / temperature


def _chunk_forward(raw, targets, top_ids, allowed, scale: float, softcap, temperature: float):
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
def _chunk_backward(raw, lse, entropy, targets, top_ids, allowed, g_target, g_entropy, g_top,
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
        capped = torch.tanh(_widened(raw) * (scale / softcap))
        grad = grad * (1.0 - capped * capped)
    if scale != 1.0:
        grad = grad * scale
    return grad.to(out_dtype) if out is None else out.copy_(grad)


def candidate_mask(sizes: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(C, V) bool: entry e may be sampled as token v. An empty set = full vocabulary.

    sizes: (C,) set sizes; ids: (sizes.sum(),) the sets' token ids, concatenated.
    """
    rows = torch.repeat_interleave(torch.arange(len(sizes), device=ids.device), sizes)
    mask = torch.zeros(len(sizes), vocab_size, dtype=torch.bool, device=ids.device)
    mask[rows, ids] = True
    mask[sizes == 0] = True
    return mask


@functools.cache
def _kernels(device_type: str):
    """The two passes: Triton kernels on CUDA, the torch functions above elsewhere (the CPU path
    compiles nothing)."""
    if device_type != "cuda":
        return _chunk_forward, _chunk_backward
    from asyncgrpo import head_kernels  # imports Triton, which CPU-only installs lack

    return head_kernels.chunk_forward, head_kernels.chunk_backward


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


class FusedHeadLogprobs(torch.autograd.Function):
    """hidden (E, H), weight (V, H), bias (V,) or None -> log p(target) (E,), entropy (E,), top log p
    (E, N) or None. `chunks`: list of (start, stop, candidates) covering 0..E, candidates = (set sizes
    (C,), ids) or None; each chunk's (C, V) mask is rebuilt when needed, never kept. `keep_logits`
    (one chunk only): keep its head output for backward instead of recomputing it."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, top_ids, chunks, scale, softcap, temperature, keep_logits
    ):
        if keep_logits and len(chunks) != 1:
            raise ValueError(f"keep_logits needs the entries as one chunk, got {len(chunks)}")
        dtype = _compute_dtype(hidden)
        forward_kernel, _ = _kernels(hidden.device.type)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)  # once per call, not once per chunk
            b = None if bias is None else bias.to(dtype)
            outputs = []
            for start, stop, candidates in chunks:
                allowed = None if candidates is None else candidate_mask(*candidates, w.shape[0])
                raw = torch.nn.functional.linear(hidden[start:stop].to(dtype), w, b)
                chunk_top = None if top_ids is None else top_ids[start:stop]
                outputs.append(
                    forward_kernel(raw, targets[start:stop], chunk_top, allowed, scale, softcap, temperature)
                )
        target_logp = torch.cat([o[0] for o in outputs])
        entropy = torch.cat([o[1] for o in outputs])
        top_logp = None if top_ids is None else torch.cat([o[2] for o in outputs])
        lse = torch.cat([o[3] for o in outputs])
        ctx.save_for_backward(hidden, weight, bias, targets, top_ids, lse, entropy)
        # Not saved tensors: the first backward overwrites the logits with their gradient and drops
        # them, so a second one (retain_graph) recomputes them instead of reading the gradient.
        ctx.kept_logits, ctx.cast_weight = (raw, w) if keep_logits else (None, None)
        ctx.chunks, ctx.scale, ctx.softcap, ctx.temperature, ctx.dtype = (
            chunks,
            scale,
            softcap,
            temperature,
            dtype,
        )
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        return target_logp, entropy, top_logp

    @staticmethod
    def backward(ctx, g_target, g_entropy, g_top):
        hidden, weight, bias, targets, top_ids, lse, entropy = ctx.saved_tensors
        kept, w = ctx.kept_logits, ctx.cast_weight
        ctx.kept_logits = ctx.cast_weight = None
        dtype = ctx.dtype
        _, backward_kernel = _kernels(hidden.device.type)
        if g_target is None:
            g_target = torch.zeros_like(lse)
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = grad_bias = None  # accumulated in fp32 at least
        accumulate_dtype = torch.promote_types(weight.dtype, torch.float32)
        with torch.autocast(hidden.device.type, enabled=False):
            if w is None:
                w = weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            for start, stop, candidates in ctx.chunks:
                allowed = None if candidates is None else candidate_mask(*candidates, w.shape[0])
                h = hidden[start:stop].to(dtype)
                raw = kept if kept is not None else torch.nn.functional.linear(h, w, b)
                rows = slice(start, stop)
                grad_raw = backward_kernel(
                    raw, lse[rows], entropy[rows], targets[rows],
                    None if top_ids is None else top_ids[rows], allowed, g_target[rows],
                    None if g_entropy is None else g_entropy[rows], None if g_top is None else g_top[rows],
                    ctx.scale, ctx.softcap, ctx.temperature, dtype, out=raw,
                )  # fmt: skip
                if grad_hidden is not None:
                    grad_hidden[rows] = (grad_raw @ w).to(hidden.dtype)
                if want_weight:
                    part = grad_raw.t() @ h
                    grad_weight = part.to(accumulate_dtype) if grad_weight is None else grad_weight.add_(part)
                if want_bias:
                    part = grad_raw.sum(0)
                    grad_bias = part.to(accumulate_dtype) if grad_bias is None else grad_bias.add_(part)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None
