"""The Triton head passes (`asyncgrpo.kernels.head_kernels`) against the torch reference passes, on any
device. Used by tests/unit/test_fused_head.py twice: on a GPU (compiled kernels, a real 152k vocabulary)
and on CPU through Triton's interpreter, where this file runs as a script in a process of its own with
TRITON_INTERPRET=1 (Triton reads it when the kernels are defined, so it cannot be set in a process
that may already have imported them).
"""

from __future__ import annotations

import itertools

import torch


def check_head_kernels(device: str, vocab: int, entries: int, dtype, transforms: bool, candidates: bool):
    """Forward against float64, backward (with and without the entropy and top-N gradients) against
    the fp32 torch pass; logits with the awkward cases: a vocabulary that is no multiple of the
    kernels' blocks, padding top ids (-1), a target among the top ids, a top id twice, and (with
    candidate sets) a row whose only allowed logit is in the vocabulary's last partial block."""
    from asyncgrpo.kernels import head_kernels, head_reference

    top_n = 8
    gen = torch.Generator(device=device).manual_seed(3)
    raw = (torch.randn(entries, vocab, device=device, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, vocab, (entries,), device=device, generator=gen)
    top_ids = torch.randint(0, vocab, (entries, top_n), device=device, generator=gen)
    top_ids[::3, -2:] = -1
    top_ids[::5, 0] = targets[::5]  # a target among the top ids: both gradient terms at one column
    top_ids[1, 3] = top_ids[1, 4]  # a top id twice
    allowed = None
    if candidates:
        allowed = torch.rand(entries, vocab, device=device, generator=gen) < 0.01
        allowed[::4] = True  # empty set = the whole vocabulary
        allowed[torch.arange(entries, device=device), targets] = True
        allowed[2] = False
        allowed[2, vocab - 3] = True
        targets[2] = vocab - 3
    transform = (0.7, 30.0) if transforms else (1.0, None)
    args = (*transform, 0.9)
    exact = head_reference.chunk_forward(raw.double(), targets, top_ids, allowed, *args)
    got = head_kernels.chunk_forward(raw, targets, top_ids, allowed, *args)
    for name, expected, value in zip(("target", "entropy", "top", "lse"), exact, got):
        assert torch.equal(torch.isinf(expected), torch.isinf(value)), name
        finite = torch.isfinite(expected)
        # Against float64: fp32 sums over 152k logits leave the entropy (lse minus a mean logit, both
        # ~20 here) ~1e-5 off, in the kernels (measured up to 1.1e-5) as in the fp32 torch passes.
        torch.testing.assert_close(value[finite].double(), expected[finite], rtol=2e-5, atol=3e-5, msg=name)
    lse, entropy = exact[3].float(), exact[1].float()
    g_target, g_entropy = torch.randn(2, entries, device=device, generator=gen)
    g_top = torch.randn(entries, top_n, device=device, generator=gen)
    for with_entropy, with_top in ((True, True), (False, True), (True, False)):
        gradients = (g_target, g_entropy if with_entropy else None, g_top if with_top else None)
        backward_args = (lse, entropy, targets, top_ids, allowed, *gradients, *args, dtype)
        expected = head_reference.chunk_backward(raw, *backward_args).float()
        in_place = raw.clone()
        value = head_kernels.chunk_backward(in_place, *backward_args, out=in_place)
        assert value.data_ptr() == in_place.data_ptr()
        # bf16: one rounding apart at most; fp32: the kernels' exp and tanh against torch's
        step = 1e-4 if dtype == torch.float32 else 2.0**-7
        wrong = (value.float() - expected).abs() > step * expected.abs() + 1e-6
        assert not wrong.any(), f"{int(wrong.sum())} wrong, first at {wrong.nonzero()[:3].tolist()}"
        assert expected.abs().sum() > 0


if __name__ == "__main__":  # on CPU, under TRITON_INTERPRET=1: a small vocabulary, every case
    cases = itertools.product((torch.float32, torch.bfloat16), (False, True), (False, True))
    for dtype, transforms, candidates in cases:
        check_head_kernels("cpu", 5000, 12, dtype, transforms, candidates)
        print(f"ok {dtype} transforms={transforms} candidates={candidates}", flush=True)
