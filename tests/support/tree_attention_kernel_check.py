"""asyncgrpo's tree-attention kernels (`asyncgrpo.packing.tree_attention_kernel`) against dense attention
with the tree mask in float64: output, log-sum-exp path and the gradients of q, k and v, zero output
and gradients on padding rows. Used twice: by tests/unit/test_tree_attention.py on CPU through Triton's
interpreter (this file runs as a script in a process of its own with TRITON_INTERPRET=1, which
Triton reads when the kernels are defined), and by the GPU test at the models' shapes.

The tries: random multi-level ones (segments of 1-39 tokens, several tiles and key blocks, ancestors
that touch their child and ones that do not), GRPO groups (a prompt and completions longer than a
tile), a row of one segment and a row of roots only (plain padding-free packing).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_tree_attention import dense_allowed, random_tree  # noqa: E402


def group_tree(prompt: int, completions: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(subtree_end, positions) of one GRPO group: a prompt, then its completions."""
    total = prompt + sum(completions)
    ends, positions, start = [np.full(prompt, total)], [np.arange(prompt)], prompt
    for length in completions:
        ends.append(np.full(length, start + length))
        positions.append(prompt + np.arange(length))
        start += length
    return np.concatenate(ends).astype(np.int64), np.concatenate(positions).astype(np.int64)


def roots_tree(lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
    ends = np.concatenate([np.full(n, sum(lengths[: i + 1])) for i, n in enumerate(lengths)])
    return ends.astype(np.int64), np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)


def check_kernel(device, subtree_end, heads, kv_heads, head_dim, dtype, transposed: bool, seed: int) -> dict:
    """Kernel against dense float64 on fresh random inputs; returns the relative errors."""
    from asyncgrpo.packing.tree_attention import padded_length, tree_layout
    from asyncgrpo.packing.tree_attention_kernel import tree_attention_kernel

    num_tokens = len(subtree_end)
    length = padded_length(num_tokens)
    layout = tree_layout(subtree_end, device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def make(h):
        if transposed:  # transformers' layout: (1, L, H, D) memory seen as (1, H, L, D)
            return torch.randn(1, length, h, head_dim, device=device, generator=gen).to(dtype).transpose(1, 2)
        return torch.randn(1, h, length, head_dim, device=device, generator=gen).to(dtype)

    q, k, v = (make(h).requires_grad_() for h in (heads, kv_heads, kv_heads))
    scale = head_dim**-0.5
    out = tree_attention_kernel(q, k, v, layout, scale)
    grad = torch.randn(out.shape, device=device, generator=gen).to(dtype)
    out.backward(grad)

    ends = torch.from_numpy(subtree_end).to(device)
    allowed = dense_allowed(ends, torch.zeros_like(ends), None)
    qd, kd, vd = (t.detach()[:, :, :num_tokens].double().requires_grad_() for t in (q, k, v))
    groups = heads // kv_heads
    scores = qd @ kd.repeat_interleave(groups, 1).transpose(-1, -2) * scale
    ref = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ vd.repeat_interleave(groups, 1)
    ref.backward(grad[:, :, :num_tokens].double())

    def error(got, want):
        got, want = got.detach().double(), want.detach()
        return float((got - want).norm() / want.norm())

    errors = {"out": error(out[:, :, :num_tokens], ref)}
    for name, leaf, want in (("dq", q, qd.grad), ("dk", k, kd.grad), ("dv", v, vd.grad)):
        errors[name] = error(leaf.grad[:, :, :num_tokens], want)
        assert (leaf.grad[:, :, num_tokens:] == 0).all(), f"{name}: gradient on padding rows"
    assert (out[:, :, num_tokens:] == 0).all(), "output on padding rows"
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    assert all(e < bound for e in errors.values()), errors
    return errors


def compiled_layer_check(device: str, backend: str = "inductor") -> int:
    """A tiny Qwen3 model with compiled decoder layers (torch.compile's defaults, dynamic shapes, as the
    trainer compiles them) runs the kernels over each row's TreeLayout, as operators inside the
    layer's graph: log-probs and gradients as the flex path's (uncompiled) give, and a second row
    length compiles nothing new. Returns the number of graphs compiled."""
    import copy

    from torch._dynamo.utils import counters

    from asyncgrpo.cli.tiny_model import build_model, build_tokenizer
    from asyncgrpo.losses.token_logprobs import row_logprobs
    from asyncgrpo.packing import tree_attention
    from asyncgrpo.packing.tree_attention import enable_tree_attention
    from asyncgrpo.packing.trie import pack_row
    from asyncgrpo.records.sample import Sample

    torch.manual_seed(0)
    flex_model = enable_tree_attention(build_model(build_tokenizer())).to(device)
    kernel_model = copy.deepcopy(flex_model)
    for layer in kernel_model.model.layers:
        layer.compile(dynamic=True, backend=backend)
    rng = np.random.default_rng(0)
    original = tree_attention.tree_attention_choice
    graphs = []
    for prompt, lengths in ((30, [140, 9, 25]), (70, [12, 150, 33, 8])):
        ids = rng.integers(1, 200, prompt)
        samples = []
        for n in lengths:
            tokens = np.concatenate([ids, rng.integers(1, 200, n)])
            trained = np.arange(len(tokens)) >= prompt
            samples.append(Sample(tokens, trained, np.zeros(n, np.float32), 1.0, 0))
        row = pack_row(samples)
        results = []
        for model, choice in ((flex_model, "flex"), (kernel_model, "triton")):
            tree_attention.tree_attention_choice = lambda device_type, choice=choice: choice
            try:
                model.zero_grad()
                logprobs = row_logprobs(model, row).logprobs
                logprobs.sum().backward()
            finally:
                tree_attention.tree_attention_choice = original
            grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            results.append((logprobs.detach(), grads))
        (want, want_grads), (got, got_grads) = results
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        assert float((got_grads - want_grads).norm() / want_grads.norm()) < 1e-4
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0], f"a second row length compiled again: {graphs}"
    breaks = sum(counters["graph_break"].values())
    assert not breaks, f"the compiled layers broke their graphs: {dict(counters['graph_break'])}"
    return graphs[1]


# (head dim, query heads, key/value heads) of the models the benchmarks train, for the GPU test.
GPU_SHAPES = {"qwen3": (128, 16, 8), "qwen3_5": (256, 8, 2), "qwen3_moe": (128, 32, 4), "mha-64": (64, 4, 4)}


def gpu_trees():
    """Rows like the trainer's, long enough for many tiles: GRPO groups of long completions, a
    random multi-level trie, plain packing."""
    rng = np.random.default_rng(21)
    yield (
        "groups",
        np.concatenate([group_tree(200, [700, 1400, 333, 45])[0], 2678 + group_tree(99, [513, 1])[0]]),
    )
    yield "random", random_tree(rng, 2000)[0]
    yield "roots", roots_tree([1000, 1, 700, 129])[0]


def cases():
    rng = np.random.default_rng(11)
    yield "random 170 G=2", random_tree(rng, 170)[0], 4, 2, 32, torch.float32, True
    yield "random 110 G=1", random_tree(rng, 110)[0], 2, 2, 16, torch.float32, False
    yield "random 90 G=3 D=40", random_tree(rng, 90)[0], 6, 2, 40, torch.float32, True
    yield "group G=4", group_tree(37, [40, 3, 21, 1])[0], 8, 2, 16, torch.float32, True
    yield "one segment", group_tree(100, [])[0], 2, 1, 16, torch.float32, False
    yield "roots", roots_tree([33, 1, 40, 7])[0], 4, 2, 16, torch.float32, True
    yield "random 120 bf16", random_tree(rng, 120)[0], 4, 2, 32, torch.bfloat16, True


if __name__ == "__main__":  # on CPU under TRITON_INTERPRET=1: small shapes, every case
    for seed, (name, subtree_end, *shape) in enumerate(cases()):
        errors = check_kernel("cpu", subtree_end, *shape, seed=seed)
        print(f"ok {name} " + " ".join(f"{k}={v:.1e}" for k, v in errors.items()), flush=True)
