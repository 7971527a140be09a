"""Tree packing of Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next): a packed row gives each sample
exactly what forwarding it alone gives, log-probs and gradients, and the layout's pieces (path
convolution, segment parents, levels) are what a hand-drawn trie says."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_logprobs import check_gradients, check_packed_equals_unpacked, completion_sample, random_trie_samples
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from asyncgrpo.packing.gated_deltanet import recurrent_layout, tree_causal_conv1d, tree_gdn_forward
from asyncgrpo.packing.tree_attention import enable_tree_attention
from asyncgrpo.packing.trie import PrefixTrie, pack_row
from asyncgrpo.tiny_model import build_model, build_tokenizer

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


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_vl", "qwen3_next"])
def models(request):
    """(plain model, tree-packed copy with the same weights) of each GDN family."""
    if request.param == "qwen3_next":
        plain = _qwen3_next()
    else:
        vision = request.param == "qwen3_5_vl"
        plain = build_model(build_tokenizer(vision=vision), arch=request.param)
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
    samples = [completion_sample(rng, prompt, rng.integers(0, VOCAB, int(rng.integers(3, 20)))) for _ in range(6)]
    row = check_packed_equals_unpacked(*models, samples)
    assert row.packing_ratio > 3


@pytest.mark.parametrize("seed", [3, 4])
def test_random_tries(models, seed):
    """Multi-level tries: several groups, forks, multi-turn continuations, a sample that is a
    prefix of another."""
    rng = np.random.default_rng(seed)
    row = check_packed_equals_unpacked(*models, random_trie_samples(rng))
    assert len(set(row.segment_ids.tolist())) > 8


def test_packed_gradient_equals_unpacked(models):
    """fp32 through the whole model; the recurrence's chunks start at other positions than in the
    per-sample forward, so the round-off differs: measured <= 7e-5 of a gradient's norm (A_log)."""
    rng = np.random.default_rng(6)
    check_gradients(*models, random_trie_samples(rng), rng, rtol=3e-4)


def _sample_paths(samples, row):
    """Each sample's packed indices, rebuilt from the row: token i of a sample is the packed token
    that predicts its entry i + 1, or (last token) follows its previous token in the row."""
    trie = PrefixTrie()
    for sample in samples:
        trie.add(sample)
    order = trie._layout()
    lengths = np.array([len(segment.tokens) for segment in order])
    starts = np.cumsum(lengths) - lengths
    terminal = {index: segment for segment in order for index, _ in segment.terminals}
    paths = []
    for index, sample in enumerate(samples):
        segment, path = terminal[index], []
        while segment is not trie._root:
            path.append(segment)
            segment = segment.parent
        indices = np.concatenate([starts[s.index] + np.arange(len(s.tokens)) for s in reversed(path)])
        paths.append(indices[: sample.num_tokens])
    return paths


def test_layer_is_exact_in_fp64():
    """One GDN layer in float64, outputs and parameter gradients: packed == each sample alone up to
    fp64 round-off, which shows the tree path computes the same function, not an approximation."""
    model = build_model(build_tokenizer(), arch="qwen3_5").double()
    gdn, embed = model.model.layers[0].linear_attn, model.model.embed_tokens
    rng = np.random.default_rng(7)
    samples = random_trie_samples(rng)
    row = pack_row(samples)
    paths = _sample_paths(samples, row)
    layout = recurrent_layout(row.segment_ids, row.subtree_end, model.config.linear_conv_kernel_dim)
    packed = tree_gdn_forward(gdn, embed(torch.from_numpy(row.input_ids))[None], layout)[0]
    weights = torch.randn(packed.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    (packed * weights).sum().backward()
    packed_grads = {name: p.grad.clone() for name, p in gdn.named_parameters()}
    gdn.zero_grad()
    # The same loss from the samples alone: a packed token shared by m samples gives each 1/m of its weight.
    multiplicity = np.bincount(np.concatenate(paths), minlength=row.num_tokens)
    for sample, path in zip(samples, paths):
        alone = gdn(embed(torch.from_numpy(sample.token_ids))[None])[0]
        torch.testing.assert_close(packed[path].detach(), alone.detach(), rtol=0, atol=1e-10)
        share = torch.from_numpy(1.0 / multiplicity[path])[:, None]
        (alone * weights[path] * share).sum().backward()
    for name, p in gdn.named_parameters():
        # The models compute the decay g in fp32 (`A_log.float()`), so A_log's and dt_bias's
        # gradients are fp32 sums whose order differs between the packed and unpacked forwards.
        rtol = 1e-5 if name in ("A_log", "dt_bias") else 1e-9
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=rtol, atol=1e-10, msg=name)
