"""The path convolution of a Gated DeltaNet layer: each token's K-1 predecessors along its trie path.

`tree_causal_conv1d` is the definition. The layers run `path_conv_and_activate`: convolution and
activation in one kernel on CUDA (asyncgrpo's Triton kernel, `packing.tree_conv`, or fla-core's varlen
`causal_conv1d`; `packing.kernel_choice` says which), elsewhere `F.conv1d` as the model computes it,
with the rows after each segment start recomputed along their paths. docs/models.md, "Gated DeltaNet
hybrids".
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers.activations import ACT2FN

from asyncgrpo.packing.kernel_choice import path_conv_choice
from asyncgrpo.packing.recurrent_layout import RecurrentLayout


def tree_causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_index: torch.Tensor
) -> torch.Tensor:
    """Depthwise causal convolution along trie paths, for the rows of `conv_index`: x (P, C), weight
    (C, K), conv_index (R, K) -> (R, C), in the weight's dtype.

    out[r] = bias + sum_j weight[:, j] * x[conv_index[r, j]], a missing predecessor (index P) reading
    zero; the same terms as `F.conv1d(..., padding=K - 1)` on the sample alone. One (R, C) gather per
    tap, never an (R, K, C) tensor. The definition; the layers run it only on the rows a plain
    convolution gets wrong (`path_conv_and_activate`).
    """
    num_tokens = x.shape[0]
    out = None
    for j in range(weight.shape[1]):
        index = conv_index[:, j]
        tap = x.index_select(0, index.clamp(max=num_tokens - 1)).to(weight.dtype)
        term = tap * (index < num_tokens)[:, None] * weight[:, j]
        out = term if out is None else out + term
    return out if bias is None else out + bias


def _plain_conv_and_activate(mixed, weight, bias, layout: RecurrentLayout, activation: str) -> torch.Tensor:
    """act(path convolution) as the model computes its own convolution (`F.conv1d`, bf16 under
    autocast), then the rows whose path predecessors are not the rows just before them (segment
    starts) replaced by `tree_causal_conv1d`. Run under `checkpoint`: backward recomputes it from
    `mixed` instead of keeping the convolution's output."""
    num_tokens, channels = mixed.shape
    kernel_size = weight.shape[1]
    out = F.conv1d(mixed.T[None], weight[:, None], bias, padding=kernel_size - 1, groups=channels)
    out = out[0, :, :num_tokens].T
    rows = layout.conv_fix_rows
    if len(rows):
        fixed = tree_causal_conv1d(mixed, weight, bias, layout.conv_index[rows])
        out = out.index_put((rows,), fixed.to(out.dtype))
    return ACT2FN[activation](out).to(mixed.dtype)


FUSED_CONV_ACTIVATIONS = ("silu", "swish")  # the activation the fused convolutions apply themselves


@functools.cache
def _fla_causal_conv1d():
    """fla's varlen causal convolution (Triton)."""
    from fla.modules.causal_conv1d import causal_conv1d

    return causal_conv1d


def _fla_conv_and_activate(mixed, weight, bias, layout: RecurrentLayout, activation: str):
    """act(path convolution) in one fla kernel: every segment a sequence of a varlen convolution whose
    initial state holds the K-1 tokens before it on its path (its parent's tail). fla computes in fp32
    from the input's dtype and returns that dtype; backward gives the initial states' gradient, which
    autograd adds to the parents' tail rows."""
    num_tokens, channels = mixed.shape
    predecessors = layout.segment_predecessors  # (G, K-1)
    taps = mixed.index_select(0, predecessors.clamp(max=num_tokens - 1).flatten())
    taps = taps.view(*predecessors.shape, channels) * (predecessors < num_tokens)[..., None]
    # fla's initial state (G, C, K): column K - s holds the token s steps before the segment; column 0
    # is never read.
    initial = F.pad(taps.transpose(1, 2), (1, 0))
    out, _ = _fla_causal_conv1d()(
        mixed[None],
        weight,
        bias,
        initial_state=initial,
        activation=activation,
        cu_seqlens=layout.segment_cu_seqlens,
        cu_seqlens_cpu=layout.segment_cu_seqlens_cpu,
    )
    return out[0]


PATH_CONV_NAMES = {
    "triton": "asyncgrpo's Triton kernel",
    "fla": "fla's varlen causal_conv1d",
    "conv1d": "F.conv1d with segment starts fixed up",
}


def path_conv_name(device_type: str) -> str:
    """Which path convolution `path_conv_and_activate` runs on a device of this type."""
    return PATH_CONV_NAMES[path_conv_choice(device_type)]


def path_conv_and_activate(
    mixed, weight, bias, layout: RecurrentLayout, activation: str, widths: tuple[int, ...]
) -> tuple[torch.Tensor, ...]:
    """act(depthwise causal convolution along trie paths) of mixed (P, C) in layer order, split along
    the channels into tensors of `widths` (q, k and v: each contiguous on the Triton path, views
    elsewhere), in mixed's dtype. The kernel: `packing.kernel_choice.path_conv_choice`; the fused
    kernels apply SiLU themselves, other activations take `F.conv1d`."""
    choice = path_conv_choice(mixed.device.type) if activation in FUSED_CONV_ACTIVATIONS else "conv1d"
    if choice == "triton":
        from asyncgrpo.packing.tree_conv import tree_conv_silu  # imports Triton: CUDA only

        return tree_conv_silu(mixed, weight, bias, layout, widths)
    if choice == "fla":
        out = _fla_conv_and_activate(mixed, weight, bias, layout, activation)
    else:
        out = checkpoint(
            _plain_conv_and_activate, mixed, weight, bias, layout, activation, use_reentrant=False
        )
    return torch.split(out, list(widths), dim=-1)
