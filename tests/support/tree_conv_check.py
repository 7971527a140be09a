"""The Triton path convolution (`asyncgrpo.packing.tree_conv`) against its per-tap definition
(`tree_causal_conv1d` then SiLU, in fp64), values and gradients. Used by tests/unit/test_gated_deltanet.py
on CPU through Triton's interpreter, where this file runs as a script in a process of its own with
TRITON_INTERPRET=1 (Triton reads it when the kernels are defined); the GPU test
(tests/gpu/test_gated_deltanet_gpu.py) runs the compiled kernels at the Qwen3.5-2B channel count.
Each case runs at the kernels' own tiles, and in fp32 at small ones (16 rows, 32 channels), so that
a trie spans several backward tiles (each hands its last K - 1 rows to the next) and q, k and v
several channel blocks, some partial.
"""

from __future__ import annotations

import numpy as np

CHANNELS = 150  # one whole block of the kernels' 128 channels and one partial block
WIDTHS = (48, 48, 54)  # q, k, v: none a multiple of the small tiles' 32 channels
# (parents, lengths) of each trie: the whole row one segment (one level, no branch), roots only (one
# level, a zero-reading start per root), a chain of segments shorter than K - 1, one GRPO group (a
# prompt read by 8 completions' first rows), and a random multi-level trie; most span several of the
# kernels' 32-row blocks.
TREE_CONV_CASES = {
    "whole_row": ([-1], [70]),
    "roots": ([-1, -1, -1, -1], [5, 1, 3, 40]),
    "chain": ([-1, 0, 1, 2, 3], [5, 1, 2, 1, 30]),
    "group": ([-1, 0, 0, 0, 0, 0, 0, 0, 0], [20, 3, 1, 7, 2, 9, 1, 12, 5]),
    "random": None,  # random_tree(seed 5, 14 segments of 1..9 tokens)
}


def trie(name: str):
    from test_gated_deltanet_gpu import random_tree

    if TREE_CONV_CASES[name] is None:
        return random_tree(np.random.default_rng(5), 14, 9)
    parents, lengths = TREE_CONV_CASES[name]
    return np.array(parents), np.array(lengths)


def check_case(name: str, dtype, with_bias: bool, strided: bool, widths: tuple[int, ...]) -> None:
    """fp32: within fp32 round-off of fp64; bf16 input (fp32 weight, as under autocast): within the
    rounding of the bf16 output and input gradient."""
    import torch
    import torch.nn.functional as F
    from test_gated_deltanet_gpu import row_arrays

    from asyncgrpo.packing.path_conv import tree_causal_conv1d
    from asyncgrpo.packing.recurrent_layout import recurrent_layout
    from asyncgrpo.packing.tree_conv import tree_conv_silu

    layout = recurrent_layout(*row_arrays(*trie(name)), 4)
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(layout.num_tokens, CHANNELS + 9, generator=gen).to(dtype)
    mixed = (
        wide[:, 5 : 5 + CHANNELS] if strided else wide[:, :CHANNELS].contiguous()
    )  # rows of a wider matmul
    weight = torch.randn(CHANNELS, 4, generator=gen) / 2
    bias = torch.randn(CHANNELS, generator=gen) if with_bias else None
    cotangent = torch.randn(layout.num_tokens, CHANNELS, generator=gen, dtype=torch.float64)

    exact = [t.double().requires_grad_() for t in (mixed, weight) + ((bias,) if with_bias else ())]
    want = F.silu(tree_causal_conv1d(exact[0], exact[1], exact[2] if with_bias else None, layout.conv_index))
    want_grads = torch.autograd.grad((want * cotangent).sum(), exact)
    leaves = [t.detach().clone().requires_grad_() for t in (mixed, weight) + ((bias,) if with_bias else ())]
    outs = tree_conv_silu(leaves[0], leaves[1], leaves[2] if with_bias else None, layout, widths)
    assert [out.shape[1] for out in outs] == list(widths) and all(out.is_contiguous() for out in outs)
    got = torch.cat(outs, dim=1)
    got_grads = torch.autograd.grad((got.double() * cotangent).sum(), leaves)
    assert got.dtype == dtype and got.shape == want.shape
    assert [g.dtype for g in got_grads] == [leaf.dtype for leaf in leaves]
    for label, value, expected in zip(("out", "d mixed", "d weight", "d bias"), (got, *got_grads),
                                      (want, *want_grads)):  # fmt: skip
        value, expected = value.detach().double(), expected.detach()
        assert expected.abs().sum() > 0, label
        if dtype == torch.float32:
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-5, msg=label)
        else:  # relative error of the whole tensor: bf16 rounds each element by up to 2^-9
            error = float((value - expected).norm() / expected.norm())
            assert error <= 1e-2, (label, error)


if __name__ == "__main__":  # on CPU, under TRITON_INTERPRET=1
    import torch

    from asyncgrpo.packing import tree_conv

    dtypes = ((torch.float32, False, True, WIDTHS), (torch.bfloat16, True, False, (CHANNELS,)))
    for name in TREE_CONV_CASES:
        for dtype, with_bias, strided, widths in dtypes:
            check_case(name, dtype, with_bias, strided, widths)
            print(
                f"ok kernel tiles {name} {dtype} bias={with_bias} strided={strided} widths={widths}",
                flush=True,
            )
    # Small tiles (16 rows, 13 owned; 32 channels): every trie spans several backward tiles.
    tree_conv.FORWARD_TILE, tree_conv.BACKWARD_TILE = tree_conv.Tile(16, 32, 1), tree_conv.Tile(16, 32, 1)
    for name in TREE_CONV_CASES:
        check_case(name, *dtypes[0])
        print(f"ok small tiles {name}", flush=True)
