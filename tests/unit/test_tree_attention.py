"""Tree attention: the BlockMask rule, the compiled flex kernel against a dense SDPA reference
(forward and the CPU blockwise backward), sliding windows, softcapping, recompilation, the models
enable_tree_attention must refuse, and asyncgrpo's own kernels (their tile lists against the rule;
the kernels in Triton's interpreter and compiled for Hopper on CPU, compiled on a GPU)."""

import numpy as np
import pytest
import torch
from interpreted import run_interpreted
from torch._dynamo.utils import counters
from transformers import GptOssConfig, GptOssForCausalLM

from asyncgrpo.cli.tiny_model import build_model, build_tokenizer
from asyncgrpo.packing import tree_tiles
from asyncgrpo.packing.tree_attention import (
    TREE_ATTENTION,
    build_tree_block_mask,
    enable_tree_attention,
    padded_length,
    tree_attention,
    tree_attention_forward,
)


def random_tree(rng: np.random.Generator, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(subtree_end, position_ids) of a random trie with exactly num_tokens packed tokens.

    Segments pick a random earlier segment (or the root) as parent; the layout is depth-first, as
    in PackedRow. Built independently of trie.py so the attention tests do not depend on it.
    """
    parents, lengths = [], []
    while sum(lengths) < num_tokens:
        parents.append(int(rng.integers(-1, len(parents))))
        lengths.append(int(min(rng.integers(1, 40), num_tokens - sum(lengths))))
    children = {i: [] for i in range(-1, len(parents))}
    for i, p in enumerate(parents):
        children[p].append(i)
    order, stack = [], children[-1][::-1]
    while stack:
        s = stack.pop()
        order.append(s)
        stack.extend(children[s][::-1])
    depth = {-1: 0}
    start, subtree = {}, {}
    pos = 0
    for s in order:
        depth[s] = depth[parents[s]] + (lengths[parents[s]] if parents[s] >= 0 else 0)
        start[s] = pos
        pos += lengths[s]
    for s in reversed(order):
        subtree[s] = lengths[s] + sum(subtree[c] for c in children[s])
    subtree_end = np.concatenate([np.full(lengths[s], start[s] + subtree[s]) for s in order])
    positions = np.concatenate([depth[s] + np.arange(lengths[s]) for s in order])
    return subtree_end.astype(np.int64), positions.astype(np.int64)


def dense_allowed(subtree_end: torch.Tensor, positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """(P, P) bool: the rule of PackedRow written out densely."""
    index = torch.arange(len(subtree_end), device=subtree_end.device)
    q, kv = index[:, None], index[None, :]
    allowed = (kv <= q) & (q < subtree_end[None, :])
    if window is not None:
        allowed &= positions[:, None] - positions[None, :] < window
    return allowed


def reference_attention(q, k, v, allowed, scale, softcap=None):
    """Dense masked attention: SDPA with the boolean mask, or eager when softcapped."""
    if softcap is None:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True
        )
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = softcap * torch.tanh(q @ k.transpose(-1, -2) * scale / softcap)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


def compare_with_reference(rng, num_tokens, window=None, softcap=None, heads=(4, 2), dim=32, device="cpu"):
    """Fresh random q/k/v (padded rows random too): forward and gradients vs the dense reference."""
    subtree_end, positions = (torch.from_numpy(a).to(device) for a in random_tree(rng, num_tokens))
    mask = build_tree_block_mask(subtree_end, positions, window)
    length = padded_length(num_tokens)
    assert mask.shape[-2:] == (length, length)
    # Laid out as transformers does, (B, L, H, D) transposed to (B, H, L, D): same strides as in the
    # model, so the tests exercise (and warm) the kernel the model uses.
    leaves = [
        torch.randn(1, length, h, dim, device=device, requires_grad=True)
        for h in (heads[0], heads[1], heads[1])
    ]
    q, k, v = (t.transpose(1, 2) for t in leaves)
    weight = torch.randn(1, heads[0], num_tokens, dim, device=device)
    scale = dim**-0.5  # the tiny model's: a new scale is a new compiled kernel

    out = tree_attention(q, k, v, mask, scale=scale, softcap=softcap)
    assert torch.isfinite(out).all(), "padding rows must not produce NaN"
    (out[:, :, :num_tokens] * weight).sum().backward()
    grads = [t.grad.transpose(1, 2) for t in leaves]

    q_, k_, v_ = (t.detach()[:, :, :num_tokens].clone().requires_grad_() for t in (q, k, v))
    ref = reference_attention(q_, k_, v_, dense_allowed(subtree_end, positions, window), scale, softcap)
    (ref * weight).sum().backward()
    torch.testing.assert_close(out[:, :, :num_tokens], ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, (q_.grad, k_.grad, v_.grad)):
        torch.testing.assert_close(got[:, :, :num_tokens], want, atol=1e-4, rtol=1e-4)
        assert (got[:, :, num_tokens:] == 0).all(), "no gradient may flow through padding"
    with torch.no_grad():  # the no-grad path (pure compiled flex) on the same inputs
        torch.testing.assert_close(tree_attention(q, k, v, mask, scale=scale, softcap=softcap), out.detach())
    return out.detach()


def test_mask_rule_on_the_worked_example():
    """The worked example of docs/architecture.md: [p1 p2] -> [p3 a1 a2] | [p3 b1 b2]."""
    subtree_end = torch.tensor([8, 8, 5, 5, 5, 8, 8, 8])
    positions = torch.tensor([0, 1, 2, 3, 4, 2, 3, 4])
    mask = build_tree_block_mask(subtree_end, positions)
    q, kv = torch.arange(16)[:, None], torch.arange(16)[None, :]
    dense = mask.mask_mod(0, 0, q, kv)
    seen = {i: torch.nonzero(dense[i]).flatten().tolist() for i in range(10)}
    assert seen[1] == [0, 1]
    assert seen[4] == [0, 1, 2, 3, 4]
    assert seen[5] == [0, 1, 5]
    assert seen[7] == [0, 1, 5, 6, 7]
    assert seen[8] == [8] and seen[9] == [9]  # padding sees only itself


@pytest.mark.parametrize("num_tokens", [1, 7, 128, 200, 300, 513])
def test_flex_matches_dense_reference(num_tokens):
    rng = np.random.default_rng(num_tokens)
    for _ in range(3):  # fresh inputs each call: a first compiled CPU call was once seen wrong
        compare_with_reference(rng, num_tokens)


@pytest.mark.parametrize(
    "feature, seed, sizes",
    [({"window": 6}, 1, (90, 260)), ({"softcap": 0.5}, 2, (100, 300))],
    ids=["window", "softcap"],
)
def test_sliding_window_and_softcap_match_dense_reference(feature, seed, sizes):
    rng = np.random.default_rng(seed)
    for num_tokens in sizes:
        modified = compare_with_reference(rng, num_tokens, **feature)
    rng = np.random.default_rng(seed)
    for num_tokens in sizes:
        plain = compare_with_reference(rng, num_tokens)
    assert not torch.allclose(modified, plain, atol=1e-3), f"{feature} must change the output"


@pytest.mark.gpu
def test_cuda_flex_matches_dense_reference():
    """CUDA: compiled flex forward and its own backward, plain / sliding window / softcap."""
    rng = np.random.default_rng(4)
    for num_tokens in (7, 200, 513, 1000):
        compare_with_reference(rng, num_tokens, device="cuda")
        compare_with_reference(rng, num_tokens, window=6, device="cuda")
        compare_with_reference(rng, num_tokens, softcap=0.5, device="cuda")


def tiles_visible_keys(subtree_end: np.ndarray, query_tile: int, key_tile: int) -> np.ndarray:
    """(P, P) bool: the keys each query reads through the kernel's query tiles, and (checked apart)
    the queries each key tile walks: both must be exactly the rule's."""
    segments = tree_tiles.tree_segments(subtree_end)
    num_tokens = len(subtree_end)
    seen = np.zeros((num_tokens, num_tokens), bool)
    for first, end, causal, begin, count in tree_tiles.query_tiles(segments, query_tile):
        assert end - first <= query_tile
        for q in range(first, end):
            seen[q, causal : q + 1] = True
            for lo, hi in segments.ranges[begin : begin + count]:
                assert not seen[q, lo:hi].any(), "a key read twice"
                seen[q, lo:hi] = True
    walked = np.zeros_like(seen)
    for first, end, subtree in tree_tiles.key_tiles(segments, key_tile):
        for kv in range(first, end):
            walked[kv:subtree, kv] = True
    np.testing.assert_array_equal(walked, seen)
    return seen


@pytest.mark.parametrize("seed", range(6))
def test_kernel_tiles_read_exactly_the_rule(seed):
    """Every query tile's key ranges, and every key tile's query range, cover the rule's pairs and no
    other (random multi-level tries, segments of 1-39 tokens, tiles of 1, 3 and 16 tokens)."""
    rng = np.random.default_rng(seed)
    subtree_end, positions = random_tree(rng, int(rng.integers(1, 300)))
    allowed = dense_allowed(torch.from_numpy(subtree_end), torch.from_numpy(positions), None).numpy()
    for query_tile, key_tile in ((16, 16), (1, 3), (3, 1)):
        np.testing.assert_array_equal(tiles_visible_keys(subtree_end, query_tile, key_tile), allowed)


def test_kernel_tiles_of_a_grpo_group():
    """A prompt and its completions: the first completion's causal range starts at the prompt (no
    separate range), the others read the prompt as one range; longest work first."""
    subtree_end = np.r_[np.full(5, 12), np.full(3, 8), np.full(4, 12)]
    segments = tree_tiles.tree_segments(subtree_end)
    np.testing.assert_array_equal(segments.starts, [0, 5, 8])
    np.testing.assert_array_equal(segments.causal_starts, [0, 0, 8])
    assert segments.ranges.tolist() == [[0, 5]]
    tiles = tree_tiles.query_tiles(segments, 4)
    assert tiles[0].tolist() == [8, 12, 8, 0, 1]  # 4 own keys + 5 of the prompt: the most work
    with pytest.raises(ValueError, match="not a trie layout"):
        tree_tiles.tree_segments(np.array([4, 4, 6, 6, 6, 6]))  # a child's subtree past its parent's


def test_tree_attention_kernels_match_dense_in_tritons_interpreter():
    """The Triton kernels (forward, dK/dV, dQ) against dense float64 attention with the tree mask, in
    Triton's interpreter (tests/support/tree_attention_kernel_check.py): fp32 and bf16, head groups of 1-4
    (3: rows of a tile left unused), an uneven head dim, multi-level tries, GRPO groups, plain rows."""
    lines = run_interpreted("tree_attention_kernel_check.py").splitlines()
    assert sum(line.startswith("ok ") for line in lines) == 7, lines


def test_tree_attention_kernels_compile_for_hopper():
    """The kernels compile for sm_90 at the benchmarks' shapes with Hopper's matrix instructions, in
    shared memory, without spilling registers (tests/support/tree_attention_compile_check.py)."""
    lines = run_interpreted("tree_attention_compile_check.py", interpret=False).splitlines()
    assert sum(line.startswith("compiled ") for line in lines) == 6, lines


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape, dtype",
    [("qwen3", torch.bfloat16), ("qwen3_5", torch.bfloat16), ("qwen3_moe", torch.bfloat16),
     ("mha-64", torch.bfloat16), ("qwen3", torch.float32)],
    ids=["qwen3-bf16", "qwen3_5-bf16", "qwen3_moe-bf16", "mha64-bf16", "qwen3-fp32"],
)  # fmt: skip
def test_cuda_tree_attention_kernels_match_dense(shape, dtype):
    """The compiled kernels at the models' head shapes on rows of thousands of tokens, against dense
    float64: bf16 within 2e-2 relative (the inputs' rounding), fp32 within 1e-5."""
    from tree_attention_kernel_check import GPU_SHAPES, check_kernel, gpu_trees

    head_dim, heads, kv_heads = GPU_SHAPES[shape]
    for seed, (tree, subtree_end) in enumerate(gpu_trees()):
        errors = check_kernel("cuda", subtree_end, heads, kv_heads, head_dim, dtype, True, seed)
        print(tree, shape, {k: f"{v:.1e}" for k, v in errors.items()})


@pytest.mark.gpu
def test_cuda_compiled_layers_run_the_kernels():
    """Compiled decoder layers (the trainer's CUDA default) keep the kernels' operators in their graph:
    log-probs and gradients as the flex path's, no recompilation for a new row length."""
    from tree_attention_kernel_check import compiled_layer_check

    compiled_layer_check("cuda")


def test_new_row_lengths_do_not_recompile():
    rng = np.random.default_rng(3)
    for num_tokens in (140, 333):  # warm up: compiled once, with dynamic shapes
        compare_with_reference(rng, num_tokens)
    graphs = counters["stats"]["unique_graphs"]
    for num_tokens in (500, 777, 1000, 1500):
        compare_with_reference(rng, num_tokens)
    assert counters["stats"]["unique_graphs"] == graphs


def test_invalid_subtree_end_rejected():
    with pytest.raises(ValueError, match="subtree_end"):
        build_tree_block_mask(torch.tensor([1, 1, 3]), torch.tensor([0, 1, 2]))  # token 1 cannot see itself


def tiny_qwen3():
    return build_model(build_tokenizer())


def test_enable_switches_attention():
    model = enable_tree_attention(tiny_qwen3())
    assert model.config._attn_implementation == TREE_ATTENTION


def test_mask_window_must_match_layer():
    """A sliding-window layer given the full mask (or the reverse) is an error, not a silent mismatch."""
    subtree_end, positions = torch.tensor([3, 3, 3]), torch.tensor([0, 1, 2])
    full_mask = build_tree_block_mask(subtree_end, positions)
    length = padded_length(3)
    q, kv = torch.randn(1, length, 4, 32).transpose(1, 2), torch.randn(1, length, 2, 32).transpose(1, 2)
    with pytest.raises(ValueError, match="sliding_window=4"):
        tree_attention_forward(torch.nn.Module(), q, kv, kv, full_mask, sliding_window=4)
    out, weights = tree_attention_forward(torch.nn.Module(), q, kv, kv, full_mask)
    assert out.shape == (1, length, 4, 32) and weights is None  # HF layout (B, L, H, D)


def test_attention_sink_model_refused():
    config = GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match="attention sinks") as refusal:
        enable_tree_attention(GptOssForCausalLM(config))
    assert_says_what_exists(str(refusal.value))


def test_recurrent_model_other_than_gated_deltanet_refused():
    """Gated DeltaNet layers pack (tests/unit/test_gated_deltanet.py); other recurrent mixers do not."""
    from transformers import MambaConfig, MambaForCausalLM

    model = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=4))
    with pytest.raises(ValueError, match="not supported yet") as refusal:
        enable_tree_attention(model)
    assert_says_what_exists(str(refusal.value))
    model = tiny_qwen3()
    model.config.layer_types = ["full_attention", "mamba"]
    with pytest.raises(ValueError, match="'mamba' layers") as refusal:
        enable_tree_attention(model)
    assert_says_what_exists(str(refusal.value))


def assert_says_what_exists(message: str) -> None:
    """A refusal of a model names no way around it that does not exist (there is no switch to train
    without tree packing: every row is tree-packed) and points at the families that train."""
    assert "without tree packing" not in message and "docs/models.md" in message, message


def test_attention_dropout_refused():
    model = tiny_qwen3()
    model.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match="attention_dropout"):
        enable_tree_attention(model)


def test_a_tree_attention_model_still_runs_ordinary_forwards_as_sdpa():
    """After training (generation, evaluation, a plain forward) the model behaves exactly like SDPA."""
    from asyncgrpo.cli.tiny_model import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    reference = build_model(tokenizer).eval()
    tree = enable_tree_attention(build_model(tokenizer)).eval()
    ids = torch.tensor([[5, 17, 300, 42, 9, 77], [0, 0, 12, 13, 14, 15]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        got = tree(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    generated = tree.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 10)
