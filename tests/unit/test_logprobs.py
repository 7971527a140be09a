"""Trainer log-probs: a packed row gives each sample exactly what forwarding it alone gives (plain
HF forward, no packing), and the chunked head matches a direct full-vocabulary computation."""

import copy

import numpy as np
import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from asyncgrpo.cli.tiny_model import build_model, build_tokenizer
from asyncgrpo.losses.token_logprobs import OutputHead, row_logprobs, token_logprobs
from asyncgrpo.packing.tree_attention import enable_tree_attention
from asyncgrpo.packing.trie import pack_row
from asyncgrpo.records.sample import Sample

TEMPERATURE = 0.7
TOP_N = 4
VOCAB = 900  # below the tiny tokenizer's 959 tokens


@pytest.fixture(scope="module")
def models():
    """(plain sdpa model, tree-attention copy with the same weights)."""
    plain = build_model(build_tokenizer())
    return plain, enable_tree_attention(copy.deepcopy(plain))


def make_sample(rng, tokens, trained, *, top=True, candidates=False) -> Sample:
    tokens = np.asarray(tokens, dtype=np.int64)
    trained = np.asarray(trained, dtype=bool)
    num_trained = int(trained.sum())
    top_ids = top_logprobs = candidate_sets = None
    if top:
        top_ids = rng.integers(0, VOCAB, (num_trained, TOP_N))
        top_ids[:, -1] = -1  # padding, as for a sampler that returned fewer than N
        top_logprobs = np.where(top_ids >= 0, -1.0, -np.inf).astype(np.float32)
    if candidates:  # each trained token's set contains it; every third set is empty (= full vocabulary)
        candidate_sets = []
        for j, token in enumerate(tokens[trained]):
            extra = rng.integers(0, VOCAB, 20)
            candidate_sets.append(np.zeros(0, np.int64) if j % 3 == 2 else np.unique(np.append(extra, token)))
    sample = Sample(
        tokens, trained, np.zeros(num_trained, np.float32), float(rng.normal()), 0,
        top_ids=top_ids, top_logprobs=top_logprobs, candidate_sets=candidate_sets,
    )  # fmt: skip
    sample.validate()
    return sample


def completion_sample(rng, prompt, completion, **kw) -> Sample:
    tokens = np.concatenate([prompt, completion])
    trained = np.arange(len(tokens)) >= len(prompt)
    return make_sample(rng, tokens, trained, **kw)


def random_trie_samples(rng, vocab=VOCAB) -> list[Sample]:
    """A multi-level trie: a shared system prompt, two groups of rollouts, forks and multi-turn
    continuations, a sample that is a prefix of another, mixed trained/untrained shared tokens."""
    system = rng.integers(0, vocab, 12)
    samples = []
    for _ in range(2):
        prompt = np.concatenate([system, rng.integers(0, vocab, int(rng.integers(3, 15)))])
        for _ in range(3):
            first = rng.integers(0, vocab, int(rng.integers(2, 20)))
            samples.append(completion_sample(rng, prompt, first, candidates=True))
            for _ in range(int(rng.integers(0, 3))):  # later turns repeat the conversation so far
                context = np.concatenate([prompt, first, rng.integers(0, vocab, 5)])
                samples.append(
                    completion_sample(rng, context, rng.integers(0, vocab, int(rng.integers(2, 15))))
                )
        samples.append(completion_sample(rng, prompt, first[:1]))  # a prefix of the last completion
    tokens = rng.integers(0, vocab, 30)
    trained = rng.random(30) < 0.5
    trained[0] = False
    samples.append(make_sample(rng, tokens, trained, top=False))  # arbitrary trained positions
    samples.append(make_sample(rng, tokens, trained[::-1] & (np.arange(30) > 0), top=False))
    return samples


def reference_logprobs(model, samples, temperature=TEMPERATURE):
    """Forward each sample alone (plain HF forward, no packing): (logprobs, entropy, top) per entry."""
    logps, entropies, tops = [], [], []
    width = max((s.top_ids.shape[1] for s in samples if s.top_ids is not None), default=0)
    device = model.device
    with torch.no_grad():
        for s in samples:
            logits = (
                model(input_ids=torch.from_numpy(s.token_ids)[None].to(device)).logits[0].cpu() / temperature
            )
            positions = np.flatnonzero(s.trained)
            for j, i in enumerate(positions):
                row = logits[i - 1].double()
                if s.candidate_sets is not None and len(s.candidate_sets[j]):
                    allowed = torch.zeros_like(row, dtype=torch.bool)
                    allowed[torch.from_numpy(s.candidate_sets[j])] = True
                    row = row.masked_fill(~allowed, float("-inf"))
                logp = torch.log_softmax(row, -1)
                logps.append(logp[s.token_ids[i]])
                p = logp.exp()
                entropies.append(-(p * logp.masked_fill(p == 0, 0)).sum())
                top = torch.full((width,), float("-inf"), dtype=torch.float64)
                if s.top_ids is not None:
                    ids = s.top_ids[j]
                    top[: len(ids)] = torch.where(
                        torch.from_numpy(ids >= 0), logp[np.maximum(ids, 0)], float("-inf")
                    )
                tops.append(top)
    return torch.stack(logps), torch.stack(entropies), torch.stack(tops)


def check_packed_equals_unpacked(plain, tree, samples, temperature=TEMPERATURE):
    row = pack_row(samples)
    with torch.no_grad():
        got = row_logprobs(tree, row, temperature)
    got = type(got)(*(None if t is None else t.cpu() for t in (got.logprobs, got.entropy, got.top_logprobs)))
    want_logp, want_entropy, want_top = reference_logprobs(plain, samples, temperature)
    assert (got.logprobs.double() - want_logp).abs().max() <= 1e-5
    assert (got.entropy.double() - want_entropy).abs().max() <= 1e-5
    if got.top_logprobs is not None:
        finite = torch.isfinite(want_top)
        assert torch.equal(torch.isfinite(got.top_logprobs), finite)
        assert (got.top_logprobs.double()[finite] - want_top[finite]).abs().max() <= 1e-5
    return row


def test_single_sample(models):
    rng = np.random.default_rng(0)
    sample = completion_sample(rng, rng.integers(0, VOCAB, 20), rng.integers(0, VOCAB, 30), candidates=True)
    row = check_packed_equals_unpacked(*models, [sample])
    assert row.num_tokens == 50


def test_no_sharing(models):
    rng = np.random.default_rng(1)
    samples = [
        completion_sample(rng, [i, *rng.integers(0, VOCAB, 10)], rng.integers(0, VOCAB, 15)) for i in range(5)
    ]
    row = check_packed_equals_unpacked(*models, samples)
    assert row.num_tokens == row.num_unpacked_tokens == 5 * 26


def test_total_sharing(models):
    """A GRPO group: one prompt, 8 completions; the prompt is forwarded once."""
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, VOCAB, 40)
    samples = [completion_sample(rng, prompt, rng.integers(0, VOCAB, 12)) for _ in range(8)]
    row = check_packed_equals_unpacked(*models, samples)
    # The last prompt token predicts a different first completion token in each sample: it is not shared.
    assert row.num_tokens == 39 + 8 * 13


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_random_tries(models, seed):
    rng = np.random.default_rng(seed)
    samples = random_trie_samples(rng)
    row = check_packed_equals_unpacked(*models, samples)
    assert row.packing_ratio > 1.3


def check_gradients(plain, tree, samples, rng):
    """Backward of a weighted sum of the packed row's log-probs equals that of the per-sample forwards."""
    row = pack_row(samples)
    device = plain.device
    weights = torch.from_numpy(rng.normal(size=row.num_entries)).to(device)
    plain.zero_grad()
    tree.zero_grad()
    (row_logprobs(tree, row, TEMPERATURE).logprobs.double() * weights).sum().backward()
    offset = 0
    for s in samples:
        logits = plain(input_ids=torch.from_numpy(s.token_ids)[None].to(device)).logits[0] / TEMPERATURE
        positions = np.flatnonzero(s.trained)
        allowed = torch.ones(len(positions), logits.shape[-1], dtype=torch.bool, device=device)
        for j, candidates in enumerate(s.candidate_sets or []):
            if len(candidates):
                allowed[j] = False
                allowed[j, torch.from_numpy(candidates).to(device)] = True
        logp = torch.log_softmax((logits[positions - 1]).masked_fill(~allowed, float("-inf")), -1)
        target = logp.gather(1, torch.from_numpy(s.token_ids[positions])[:, None].to(device))[:, 0]
        (target.double() * weights[offset : offset + len(positions)]).sum().backward()
        offset += len(positions)
    for (name, a), b in zip(tree.named_parameters(), plain.parameters()):
        assert (a.grad - b.grad).norm() <= 1e-4 * b.grad.norm() + 1e-7, name


def test_packed_gradient_equals_unpacked(models):
    """CPU: flex forward, blockwise backward."""
    rng = np.random.default_rng(6)
    check_gradients(*models, random_trie_samples(rng), rng)


@pytest.mark.gpu
def test_cuda_packed_equals_unpacked():
    """CUDA: the compiled flex kernel forward and backward inside the model."""
    plain = build_model(build_tokenizer()).cuda()
    tree = enable_tree_attention(copy.deepcopy(plain))
    rng = np.random.default_rng(11)
    for _ in range(2):
        check_packed_equals_unpacked(plain, tree, random_trie_samples(rng))
    check_gradients(plain, tree, random_trie_samples(rng), rng)


def sliding_qwen3():
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, use_sliding_window=True, sliding_window=6, max_window_layers=1,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def softcapped_gemma2():
    config = Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=6,
        attn_logit_softcapping=0.5, final_logit_softcapping=2.0, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    return Gemma2ForCausalLM(config)


@pytest.mark.parametrize("build", [sliding_qwen3, softcapped_gemma2])
@pytest.mark.slow
def test_sliding_window_and_softcap_models(build):
    """Per-layer sliding windows (a dict of masks), attention and final logit softcapping."""
    plain = build()
    assert "sliding_attention" in plain.config.layer_types and "full_attention" in plain.config.layer_types
    tree = enable_tree_attention(copy.deepcopy(plain))
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, VOCAB, 15)
    samples = [completion_sample(rng, prompt, rng.integers(0, VOCAB, 12)) for _ in range(4)]
    check_packed_equals_unpacked(plain, tree, samples)


def test_row_logprobs_requires_tree_attention(models):
    plain, _ = models
    rng = np.random.default_rng(8)
    row = pack_row([completion_sample(rng, [1, 2], [3, 4])])
    with pytest.raises(ValueError, match="enable_tree_attention"):
        row_logprobs(plain, row)


def direct_logprobs(hidden, weight, targets, temperature, top_ids, allowed=None):
    """Full (E, V) log-softmax in one piece: what the chunked head must reproduce."""
    logits = hidden @ weight.T / temperature
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    logp = torch.log_softmax(logits, -1)
    top = logp.gather(1, top_ids.clamp(min=0)).masked_fill(top_ids < 0, float("-inf"))
    entropy = -(logp.exp() * logp.masked_fill(~torch.isfinite(logp), 0)).sum(-1)
    return logp.gather(1, targets[:, None])[:, 0], entropy, top


@pytest.mark.parametrize("chunk_size", [1, 3, 100])
def test_chunked_head_matches_direct(chunk_size):
    torch.manual_seed(0)
    hidden = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (10,))
    top_ids = torch.randint(0, 50, (10, 3))
    top_ids[::2, 2] = -1
    got = token_logprobs(hidden, weight, targets, 0.8, top_ids=top_ids, chunk_size=chunk_size)
    loss = got.logprobs.sum() + got.entropy.sum() + got.top_logprobs[top_ids >= 0].sum()
    grads = torch.autograd.grad(loss, (hidden, weight))
    logp, entropy, top = direct_logprobs(hidden, weight, targets, 0.8, top_ids)
    torch.testing.assert_close(got.logprobs, logp)
    torch.testing.assert_close(got.entropy, entropy)
    torch.testing.assert_close(got.top_logprobs, top)
    want = torch.autograd.grad(logp.sum() + entropy.sum() + top[top_ids >= 0].sum(), (hidden, weight))
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w)


def test_candidate_set_renormalization_by_hand():
    """V = 4, logits (identity head) [0, ln 2, ln 3, 0]: over the set {1, 2} p = (2/5, 3/5)."""
    hidden = torch.tensor([[0.0, np.log(2), np.log(3), 0.0]] * 3, dtype=torch.float32, requires_grad=True)
    offsets = torch.tensor([0, 2, 2, 3])  # entry 0: {1, 2}; entry 1: empty = full vocabulary; entry 2: {2}
    ids = torch.tensor([1, 2, 2])
    top_ids = torch.tensor([[2, 0, -1]] * 3)
    got = token_logprobs(
        hidden,
        torch.eye(4),
        torch.tensor([2, 2, 2]),
        1.0,
        top_ids=top_ids,
        candidate_offsets=offsets,
        candidate_ids=ids,
    )
    torch.testing.assert_close(
        got.logprobs, torch.tensor([np.log(3 / 5), np.log(3 / 7), 0.0], dtype=torch.float32)
    )
    full = np.array([1, 2, 3, 1]) / 7
    want_entropy = [-(0.4 * np.log(0.4) + 0.6 * np.log(0.6)), -(full * np.log(full)).sum(), 0.0]
    torch.testing.assert_close(got.entropy, torch.tensor(want_entropy, dtype=torch.float32))
    # Token 0 is outside the sets of entries 0 and 2: probability 0; -1 padding: -inf too.
    assert got.top_logprobs[0, 1] == float("-inf") and got.top_logprobs[2, 1] == float("-inf")
    assert np.isclose(got.top_logprobs[1, 1].item(), np.log(1 / 7), atol=1e-6)
    assert (got.top_logprobs[:, 2] == float("-inf")).all()
    # Gradients through everything, including the -inf entries, stay finite.
    valid = torch.isfinite(got.top_logprobs)
    (got.logprobs.sum() + got.entropy.sum() + got.top_logprobs[valid].sum()).backward()
    assert torch.isfinite(hidden.grad).all()


def test_output_head_softcap_and_scale():
    torch.manual_seed(1)
    hidden, weight = torch.randn(5, 8), torch.randn(20, 8)
    head = OutputHead(weight, scale=0.5, softcap=3.0)
    want = torch.tanh(hidden @ weight.T * 0.5 / 3.0) * 3.0
    torch.testing.assert_close(head.logits(hidden), want)
    got = token_logprobs(hidden, head, torch.arange(5), 2.0)
    torch.testing.assert_close(
        got.logprobs, torch.log_softmax(want / 2.0, -1)[torch.arange(5), torch.arange(5)]
    )


def test_no_trained_tokens():
    hidden = torch.randn(0, 8, requires_grad=True)
    got = token_logprobs(hidden, torch.randn(20, 8), torch.zeros(0, dtype=torch.int64), 1.0)
    assert got.logprobs.shape == (0,) and got.entropy.shape == (0,)
    got.logprobs.sum().backward()  # still part of the graph (every DDP rank must run backward)
