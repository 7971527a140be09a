"""The fused head (`fused_head.FusedHeadLogprobs`, the CUDA default) computes the same function and
the same gradients as the plain chunked path of `token_logprobs`: in float64 on CPU (its torch
passes), with its logits kept or recomputed; on a GPU, its Triton passes against the torch ones and
the whole head at the trainer's CUDA defaults."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from interpreted import run_interpreted

from asyncgrpo.losses.token_logprobs import OutputHead, token_logprobs

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


def run(case, fused: bool, chunk_size: int, temperature: float, upstream, keep_logits=False, backwards=1):
    """Values and gradients of a weighted sum of the outputs; `backwards` > 1 runs backward again on
    the retained graph and returns every round's gradients."""
    hidden, weight, bias, head_args, targets, top_ids, offsets, ids = case
    leaves = [t.clone().requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    head = OutputHead(leaves[1], leaves[2] if bias is not None else None, **head_args)
    out = token_logprobs(leaves[0], head, targets, temperature, top_ids=top_ids, candidate_offsets=offsets,
                         candidate_ids=ids, chunk_size=chunk_size, fused=fused,
                         keep_logits=keep_logits)  # fmt: skip
    g_target, g_entropy, g_top = upstream
    finite_top = out.top_logprobs.masked_fill(out.top_logprobs == float("-inf"), 0.0)
    finite_target = out.logprobs.masked_fill(out.logprobs == float("-inf"), 0.0)
    loss = (finite_target * g_target).sum() + (out.entropy * g_entropy).sum() + (finite_top * g_top).sum()
    rounds = [torch.autograd.grad(loss, leaves, retain_graph=r + 1 < backwards) for r in range(backwards)]
    return out, rounds[0] if backwards == 1 else rounds


@pytest.mark.parametrize("keep_logits", [False, True])
@pytest.mark.parametrize("transforms", [False, True])
@pytest.mark.parametrize("candidates", [False, True])
def test_fused_head_matches_plain_values_and_gradients(transforms, candidates, keep_logits):
    case = random_case(3 + 2 * transforms + candidates, transforms=transforms, candidates=candidates)
    gen = torch.Generator().manual_seed(99)
    upstream = (
        torch.randn(ENTRIES, dtype=torch.float64, generator=gen),
        torch.randn(ENTRIES, dtype=torch.float64, generator=gen),
        torch.randn(ENTRIES, TOP_N, dtype=torch.float64, generator=gen),
    )
    plain, plain_grads = run(case, fused=False, chunk_size=5, temperature=0.8, upstream=upstream)
    fused, fused_grads = run(case, fused=True, chunk_size=7, temperature=0.8, upstream=upstream,
                             keep_logits=keep_logits)  # fmt: skip
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


def test_kept_logits_are_recomputed_for_a_second_backward():
    """The first backward overwrites the kept logits with their gradient: a second one on the retained
    graph must recompute them, not read the gradient as logits."""
    case = random_case(4, transforms=True, candidates=False)
    gen = torch.Generator().manual_seed(7)
    upstream = tuple(
        torch.randn(shape, dtype=torch.float64, generator=gen)
        for shape in ((ENTRIES,), (ENTRIES,), (ENTRIES, TOP_N))
    )
    _, rounds = run(case, fused=True, chunk_size=7, temperature=0.8, upstream=upstream, keep_logits=True,
                    backwards=2)  # fmt: skip
    _, plain_grads = run(case, fused=False, chunk_size=5, temperature=0.8, upstream=upstream)
    for grads in rounds:
        for expected, got in zip(plain_grads, grads):
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


# -- on the GPU, at the trainer's CUDA defaults: fp32 weights under bf16 autocast, compiled decoder
# layers, the fused head ------------------------------------------------------------------------------


def grpo_samples(rng, vocab: int, groups: int = 2) -> list:
    """Groups of one prompt + 8 completions, long enough to cross several 128-token blocks."""
    from asyncgrpo.records.sample import Sample

    samples = []
    for group in range(groups):
        prompt = rng.integers(0, vocab, int(rng.integers(100, 300)))
        for _ in range(8):
            completion = int(rng.integers(40, 300))
            tokens = np.concatenate([prompt, rng.integers(0, vocab, completion)])
            trained = np.arange(len(tokens)) >= len(prompt)
            top_ids = rng.integers(0, vocab, (completion, TOP_N))
            top_logprobs = np.sort(np.log(rng.dirichlet(np.ones(3 * TOP_N), completion)[:, :TOP_N]), -1)[
                :, ::-1
            ]
            samples.append(Sample(tokens, trained, rng.normal(-5.0, 1.0, completion).astype(np.float32),
                                  float(rng.normal()), group, top_ids=top_ids,
                                  top_logprobs=np.ascontiguousarray(top_logprobs,
                                                                    dtype=np.float32)))  # fmt: skip
    return samples


def default_cuda_model():
    """The tiny model as the trainer runs it on CUDA by default, and an fp32 CPU copy as reference
    (plain head path; tree attention only for packed rows, SDPA for a plain forward)."""
    from asyncgrpo.cli.tiny_model import build_model, build_tokenizer
    from asyncgrpo.packing.tree_attention import enable_tree_attention
    from asyncgrpo.trainer.compile import compile_decoder_layers

    torch.manual_seed(0)
    reference = enable_tree_attention(build_model(build_tokenizer()).float())
    model = enable_tree_attention(build_model(build_tokenizer()).float().cuda())
    model.load_state_dict(reference.state_dict())
    compile_decoder_layers(model)
    return model, reference


@pytest.mark.slow
def test_head_kernels_match_the_torch_passes_in_tritons_interpreter():
    """The Triton passes' logic on every CPU run (CI has no GPU), through Triton's interpreter: the
    same checks as the GPU test below over a small vocabulary."""
    assert run_interpreted("head_kernels_check.py").count("ok ") == 8


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transforms", [False, True])
@pytest.mark.parametrize("candidates", [False, True])
def test_cuda_head_kernels_match_the_torch_passes(dtype, transforms, candidates):
    """The Triton passes vs the torch reference on the same GPU tensors, over a real vocabulary
    (151,936: not a multiple of the kernels' blocks), with the top-N, entropy and candidate terms."""
    from head_kernels_check import check_head_kernels

    check_head_kernels("cuda", 151_936, 300, dtype, transforms, candidates)


@pytest.mark.gpu
@pytest.mark.parametrize("keep_logits", [False, True])
def test_cuda_defaults_packed_logprobs_match_each_sample_alone(keep_logits):
    """Tree-packed log-probs at the CUDA defaults vs each sample forwarded alone (plain HF, fp32 CPU)."""
    from asyncgrpo.losses.token_logprobs import row_logprobs
    from asyncgrpo.packing.trie import pack_row

    model, reference = default_cuda_model()
    samples = grpo_samples(np.random.default_rng(21), model.config.vocab_size)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        packed = row_logprobs(model, pack_row(samples), keep_logits=keep_logits).logprobs.double().cpu()
    expected = []
    with torch.no_grad():
        for s in samples:
            ids = torch.from_numpy(s.token_ids)[None]
            logp = torch.log_softmax(reference(input_ids=ids).logits[0].double(), -1)
            targets = torch.from_numpy(np.flatnonzero(s.trained))
            expected.append(logp[targets - 1].gather(1, ids[0, targets][:, None])[:, 0])
    expected = torch.cat(expected)
    difference = (packed - expected).abs()
    # bf16 matmuls: per-token errors of a few hundredths of a nat on |log p| ~ 7
    assert difference.mean() < 0.02 and difference.max() < 0.15, (difference.mean(), difference.max())


@pytest.mark.gpu
@pytest.mark.parametrize("keep_logits", [False, True])
def test_cuda_defaults_loss_gradient_matches_reference(keep_logits):
    """The trainer's `row_loss` and its gradient at the CUDA defaults (logits kept when the row fits,
    recomputed otherwise) vs the same row on CPU in fp32 (plain head path): the relative error of
    bf16 compute."""
    pytest.importorskip("msgspec", reason="the trainer module needs msgspec")
    from loss_args import loss_args

    from asyncgrpo.packing.trie import pack_row
    from asyncgrpo.trainer.row_loss import row_loss

    args = loss_args(
        temperature=0.9,
        vllm_importance_sampling_clip_min=0.0,
        vllm_importance_sampling_clip_max=1e9,
        epsilon=0.2,
        epsilon_high=0.28,
        gradient_accumulation_steps=1,
        router_aux_loss_coef=None,
    )
    model, reference = default_cuda_model()
    row = pack_row(grpo_samples(np.random.default_rng(22), model.config.vocab_size))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, _ = row_loss(model, row, float(row.num_entries), args, keep_logits=keep_logits)
    loss.backward()
    expected_loss, _ = row_loss(reference, row, float(row.num_entries), args)
    expected_loss.backward()
    assert abs(float(loss) - float(expected_loss)) < 2e-2 * abs(float(expected_loss)) + 1e-3
    got = torch.cat([p.grad.double().cpu().flatten() for p in model.parameters()])
    want = torch.cat([p.grad.double().flatten() for p in reference.parameters()])
    relative = float((got - want).norm() / want.norm())
    assert relative < 3e-2, relative


@pytest.mark.gpu
@pytest.mark.parametrize("keep_logits", [False, True])
def test_cuda_fused_head_fp32_matches_fp64(keep_logits):
    """The fused head (Triton passes) in fp32 on the GPU vs the plain path in fp64 on CPU."""
    case = random_case(8, transforms=True, candidates=not keep_logits)
    gen = torch.Generator().manual_seed(5)
    upstream = tuple(
        torch.randn(shape, dtype=torch.float64, generator=gen)
        for shape in ((ENTRIES,), (ENTRIES,), (ENTRIES, TOP_N))
    )
    plain, plain_grads = run(case, fused=False, chunk_size=5, temperature=0.8, upstream=upstream)
    cuda_case = (
        tuple(
            None if t is None else t.cuda() if t.dtype != torch.float64 else t.float().cuda()
            for t in case[:3]
        )
        + (case[3],)
        + tuple(None if t is None else t.cuda() for t in case[4:])
    )
    fused, fused_grads = run(cuda_case, fused=True, chunk_size=7, temperature=0.8,
                             upstream=tuple(u.float().cuda() for u in upstream),
                             keep_logits=keep_logits)  # fmt: skip
    finite = torch.isfinite(plain.logprobs)
    torch.testing.assert_close(
        fused.logprobs.double().cpu()[finite], plain.logprobs[finite], rtol=1e-4, atol=1e-4
    )
    for expected, got in zip(plain_grads, fused_grads):
        torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-3, atol=1e-4)
