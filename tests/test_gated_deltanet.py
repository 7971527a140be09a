"""Tree packing of Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next): a packed row gives each sample
exactly what forwarding it alone gives, log-probs and gradients, and the layout's pieces (path
convolution, segment parents, levels) are what a hand-drawn trie says."""

import copy
import functools
import importlib.util
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_logprobs import TEMPERATURE, check_packed_equals_unpacked, completion_sample, random_trie_samples
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from asyncgrpo.cli.tiny_model import build_model, build_tokenizer
from asyncgrpo.logprobs import row_logprobs
from asyncgrpo.packing.gated_deltanet import fla_refusal, recurrent_layout, tree_causal_conv1d
from asyncgrpo.packing.tree_attention import enable_tree_attention
from asyncgrpo.packing.trie import pack_row

VOCAB = 900


def _qwen3_next():
    tokenizer = build_tokenizer()
    config = Qwen3NextConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        layer_types=["linear_attention", "linear_attention", "full_attention"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(config)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def models(request):
    """(plain model, tree-packed copy with the same weights) of each GDN family."""
    plain = _qwen3_next() if request.param == "qwen3_next" else build_model(build_tokenizer(), arch="qwen3_5")
    return plain, enable_tree_attention(copy.deepcopy(plain))


def test_layout_of_a_hand_drawn_trie():
    """Prompt p0 p1 p2 (segment 0), completions a0 a1 (segment 1) and b0 b1 b2 (segment 2), and a
    later turn under a: a0 a1 c0 (segment 3, its parent segment 1)."""
    segment_ids = np.array([0, 0, 0, 1, 1, 3, 2, 2, 2])
    subtree_end = np.array([9, 9, 9, 6, 6, 6, 9, 9, 9])
    layout = recurrent_layout(segment_ids, subtree_end, kernel_size=3)
    none = 9
    assert layout.conv_index.tolist() == [
        [none, none, 0], [none, 0, 1], [0, 1, 2],  # the prompt
        [1, 2, 3], [2, 3, 4],  # a0 a1 read the prompt's tail
        [3, 4, 5],  # c0 reads a0 a1
        [1, 2, 6], [2, 6, 7], [6, 7, 8],  # b0 b1 b2 read the prompt's tail, not a's
    ]  # fmt: skip
    assert [level.starts.tolist() for level in layout.levels] == [[0], [3, 6], [5]]
    assert [level.parent_rows.tolist() for level in layout.levels] == [[-1], [0, 0], [0]]
    assert layout.levels[1].gather.tolist() == [[3, 4, none], [6, 7, 8]]


def test_tree_conv_equals_conv1d_on_a_path():
    """On a single chain the path convolution is F.conv1d with left padding K - 1."""
    torch.manual_seed(0)
    x, weight, bias = torch.randn(10, 6), torch.randn(6, 4), torch.randn(6)
    layout = recurrent_layout(np.zeros(10, dtype=np.int64), np.full(10, 10), kernel_size=4)
    want = F.conv1d(x.T[None], weight[:, None], bias, padding=3, groups=6)[0, :, :10].T
    torch.testing.assert_close(tree_causal_conv1d(x, weight, bias, layout.conv_index), want)


def test_group_sharing(models):
    """A GRPO group with a long prompt: the prompt's state is computed once for 6 completions."""
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, VOCAB, 70)  # longer than one 64-token chunk of the recurrence
    samples = [
        completion_sample(rng, prompt, rng.integers(0, VOCAB, int(rng.integers(3, 20)))) for _ in range(6)
    ]
    row = check_packed_equals_unpacked(*models, samples)
    assert row.packing_ratio > 3


@pytest.mark.parametrize("seed", [3])
def test_random_tries(models, seed):
    """Multi-level tries: several groups, forks, multi-turn continuations, a sample that is a
    prefix of another."""
    rng = np.random.default_rng(seed)
    row = check_packed_equals_unpacked(*models, random_trie_samples(rng))
    assert len(set(row.segment_ids.tolist())) > 8


def test_vision_checkpoint_packs():
    """The language model inside the image-text-to-text checkpoint packs like the text-only one."""
    plain = build_model(build_tokenizer(vision=True), arch="qwen3_5_vl")
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, VOCAB, 70)
    samples = [
        completion_sample(rng, prompt, rng.integers(0, VOCAB, int(rng.integers(3, 20)))) for _ in range(4)
    ]
    row = check_packed_equals_unpacked(plain, enable_tree_attention(copy.deepcopy(plain)), samples)
    assert row.packing_ratio > 2.5


def _unpacked_gradients(model, samples, weights) -> dict[str, torch.Tensor]:
    """Parameter gradients of sum(weights * log p(entry)) over the samples forwarded one by one."""
    model.zero_grad()
    offset = 0
    for s in samples:
        logits = model(input_ids=torch.from_numpy(s.token_ids)[None]).logits[0] / TEMPERATURE
        positions = np.flatnonzero(s.trained)
        allowed = torch.ones(len(positions), logits.shape[-1], dtype=torch.bool)
        for j, candidates in enumerate(s.candidate_sets or []):
            if len(candidates):
                allowed[j] = False
                allowed[j, torch.from_numpy(candidates)] = True
        logp = torch.log_softmax(logits[positions - 1].masked_fill(~allowed, float("-inf")), -1)
        target = logp.gather(1, torch.from_numpy(s.token_ids[positions])[:, None])[:, 0]
        (target.double() * weights[offset : offset + len(positions)]).sum().backward()
        offset += len(positions)
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _relative_errors(got: dict, want: dict) -> dict[str, float]:
    return {name: ((got[name] - w).norm() / w.norm().clamp(min=1e-30)).item() for name, w in want.items()}


def test_packed_gradient_equals_unpacked(models, monkeypatch):
    """fp32, every parameter (A_log, dt_bias and the convolution weights included): the packed row's
    gradient is within 1e-5 of the per-sample forwards' (norm of the difference over the norm),
    except where the model's own fp32 arithmetic is less precise than that.

    That is the decay path (A_log, dt_bias, in_proj_a): its gradients sum terms of both signs over
    each chunk of the recurrence, and a packed row's chunks start at segment starts instead of sample
    starts, so their round-off differs. The same model forwarding the same samples alone with its
    recurrence chunked by 32 or 16 instead of 64 moves them as much (measured: qwen3_5 A_log 1.0e-4
    by packing, 1.1e-4 by re-chunking; Qwen3-Next 2.3e-4 and 2.2e-4 on another trie), so the bound
    there is twice the larger re-chunking difference, the size of the model's own fp32 round-off.
    transformers' torch chunked rule runs in fp32 whatever the model's dtype, so there is no fp64
    reference to compare with instead."""
    plain, tree = models
    rng = np.random.default_rng(6)
    samples = random_trie_samples(rng)
    row = pack_row(samples)
    weights = torch.from_numpy(rng.normal(size=row.num_entries))
    tree.zero_grad()
    (row_logprobs(tree, row, TEMPERATURE).logprobs.double() * weights).sum().backward()
    packed = {name: p.grad for name, p in tree.named_parameters() if p.grad is not None}
    alone = _unpacked_gradients(plain, samples, weights)
    modeling = sys.modules[type(plain).__module__]
    rule = modeling.torch_chunk_gated_delta_rule
    own_round_off = dict.fromkeys(alone, 0.0)
    for chunk_size in (32, 16):
        monkeypatch.setattr(
            modeling, "torch_chunk_gated_delta_rule", functools.partial(rule, chunk_size=chunk_size)
        )
        rechunked = _relative_errors(_unpacked_gradients(plain, samples, weights), alone)
        own_round_off = {name: max(own_round_off[name], rechunked[name]) for name in alone}
    assert packed.keys() == alone.keys()
    errors = _relative_errors(packed, alone)
    for name, error in errors.items():
        assert error <= max(1e-5, 2 * own_round_off[name]), (name, error, own_round_off[name])
    decay_path = ("A_log", "dt_bias", "in_proj_a.weight", "in_proj_ba.weight")
    assert max(error for name, error in errors.items() if not name.endswith(decay_path)) <= 1e-5


@pytest.mark.parametrize(
    ("capability", "triton_version", "tilelang", "nvcc", "refused"),
    [
        ((9, 0), "3.6.0", False, True, True),  # the H200 image of bench/RESULTS.md
        ((9, 0), "3.4.0", False, True, True),
        ((9, 0), "3.7.1", False, True, False),
        ((9, 0), "3.3.1", False, True, False),
        ((9, 0), "3.6.0", True, True, False),  # fla runs the kernel through tilelang
        ((9, 0), "3.6.0", True, False, True),  # tilelang without an nvcc to compile with: fla skips it
        ((8, 0), "3.6.0", False, True, False),  # not Hopper
    ],
)
def test_fla_refusal(monkeypatch, capability, triton_version, tilelang, nvcc, refused):
    """fla-core 0.6 raises in the gated delta rule's backward on Hopper with Triton in [3.4, 3.7.1)
    unless tilelang and an nvcc are found: the tree path must know beforehand and run the torch rule."""
    find_spec = importlib.util.find_spec
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=triton_version))
    monkeypatch.setitem(sys.modules, "fla.utils", types.SimpleNamespace(has_usable_nvcc=lambda: nvcc))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "tilelang" and tilelang else find_spec(name, *a),
    )
    reason = fla_refusal(torch.device("cuda"))
    assert (reason is not None) == refused
    if refused:
        assert triton_version in reason and "tilelang" in reason
