"""The fused head (`fused_head.FusedHeadLogprobs`, the CUDA default) computes the same function and
the same gradients as the plain chunked path of `token_logprobs`, in float64 on CPU (eager kernels)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncgrpo.logprobs import OutputHead, token_logprobs

VOCAB, HIDDEN, ENTRIES, TOP_N = 37, 8, 23, 4


def random_case(seed: int, *, transforms: bool, candidates: bool):
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ENTRIES, HIDDEN, dtype=torch.float64, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, dtype=torch.float64, generator=gen)
    bias = torch.randn(VOCAB, dtype=torch.float64, generator=gen) if transforms else None
    head_args = dict(scale=0.7, softcap=3.0) if transforms else {}
    top_ids = torch.from_numpy(rng.integers(0, VOCAB, (ENTRIES, TOP_N)))
    top_ids[rng.random((ENTRIES, TOP_N)) < 0.2] = -1  # padding
    targets = torch.from_numpy(rng.integers(0, VOCAB, ENTRIES))
    offsets = ids = None
    if candidates:
        sizes = rng.integers(0, 9, ENTRIES)  # 0 = the full vocabulary
        sets = [rng.choice(VOCAB, size, replace=False) for size in sizes]
        for entry, chosen in enumerate(sets):  # most targets inside their set, some outside
            if len(chosen) and rng.random() < 0.8:
                targets[entry] = int(chosen[0])
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)]))
        ids = torch.from_numpy(np.concatenate(sets).astype(np.int64))
    return hidden, weight, bias, head_args, targets, top_ids, offsets, ids


def run(case, fused: bool, chunk_size: int, temperature: float, upstream):
    hidden, weight, bias, head_args, targets, top_ids, offsets, ids = case
    leaves = [t.clone().requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    head = OutputHead(leaves[1], leaves[2] if bias is not None else None, **head_args)
    out = token_logprobs(leaves[0], head, targets, temperature, top_ids=top_ids, candidate_offsets=offsets,
                         candidate_ids=ids, chunk_size=chunk_size, fused=fused)  # fmt: skip
    g_target, g_entropy, g_top = upstream
    finite_top = out.top_logprobs.masked_fill(out.top_logprobs == float("-inf"), 0.0)
    finite_target = out.logprobs.masked_fill(out.logprobs == float("-inf"), 0.0)
    loss = (finite_target * g_target).sum() + (out.entropy * g_entropy).sum() + (finite_top * g_top).sum()
    grads = torch.autograd.grad(loss, leaves)
    return out, grads


@pytest.mark.parametrize("transforms", [False, True])
@pytest.mark.parametrize("candidates", [False, True])
def test_fused_head_matches_plain_values_and_gradients(transforms, candidates):
    case = random_case(3 + 2 * transforms + candidates, transforms=transforms, candidates=candidates)
    gen = torch.Generator().manual_seed(99)
    upstream = (
        torch.randn(ENTRIES, dtype=torch.float64, generator=gen),
        torch.randn(ENTRIES, dtype=torch.float64, generator=gen),
        torch.randn(ENTRIES, TOP_N, dtype=torch.float64, generator=gen),
    )
    plain, plain_grads = run(case, fused=False, chunk_size=5, temperature=0.8, upstream=upstream)
    fused, fused_grads = run(case, fused=True, chunk_size=7, temperature=0.8, upstream=upstream)
    for name in ("logprobs", "entropy", "top_logprobs"):
        expected, got = getattr(plain, name), getattr(fused, name)
        assert torch.equal(torch.isinf(expected), torch.isinf(got)), name
        finite = torch.isfinite(expected)
        torch.testing.assert_close(got[finite], expected[finite], rtol=1e-10, atol=1e-10, msg=name)
    if candidates:
        assert torch.isinf(plain.logprobs).any() and torch.isinf(plain.top_logprobs).any()
    for expected, got in zip(plain_grads, fused_grads):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)


def test_fused_head_without_gradient_or_entries():
    case = random_case(5, transforms=False, candidates=False)
    hidden, weight, _, _, targets, top_ids, _, _ = case
    with torch.no_grad():
        plain = token_logprobs(hidden, weight, targets, top_ids=top_ids, fused=False)
        fused = token_logprobs(hidden, weight, targets, top_ids=top_ids, fused=True, chunk_size=4)
    torch.testing.assert_close(fused.logprobs, plain.logprobs, rtol=1e-12, atol=1e-12)
    empty = token_logprobs(hidden[:0].requires_grad_(), weight, targets[:0], top_ids=top_ids[:0], fused=True)
    assert empty.logprobs.shape == (0,) and empty.top_logprobs.shape == (0, TOP_N)
