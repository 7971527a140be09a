"""The output head, log-softmax, top-N gather and entropy as one autograd function (CUDA training).

Per chunk of trained entries, forward runs the head's matmul once and one pass that reduces the
logits to what the loss reads (log p(target), entropy, log p at the sampler's top-N ids, the
log-normalizer); backward rebuilds d loss / d logits in closed form in one more pass, in place over
the logits, and runs the two gradient matmuls. `keep_logits` keeps the head output for backward
instead of recomputing it. On CUDA the passes are Triton kernels (`head_kernels`); elsewhere they are
the torch functions of `head_reference`, which are also their reference (tests/unit/test_fused_head.py).
Why, and the formulas: docs/gpu-performance.md#the-fused-output-head.
"""

from __future__ import annotations

import functools

import torch

from asyncgrpo.kernels.head_reference import chunk_backward, chunk_forward


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
    """The two passes: Triton kernels on CUDA, the torch references elsewhere (the CPU path
    compiles nothing)."""
    if device_type != "cuda":
        return chunk_forward, chunk_backward
    from asyncgrpo.kernels import head_kernels  # imports Triton, which CPU-only installs lack

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
