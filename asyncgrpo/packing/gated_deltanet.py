"""Tree packing for Gated DeltaNet layers (Qwen3.5, Qwen3.6, Qwen3-Next linear-attention layers).

Such a layer mixes tokens through a short causal convolution and a gated delta rule recurrence,
neither of which a BlockMask can express: here the convolution reads each token's predecessors along
its trie path, and each trie segment's recurrence starts from its parent's final state, level by
level, on fla's varlen kernels on CUDA or the model's own torch rule elsewhere. An exact rewrite of
forwarding each sample alone; how and why: docs/models.md, "Gated DeltaNet hybrids"."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers.activations import ACT2FN

from asyncgrpo.packing.kernel_cache import persist_kernel_autotuning

logger = logging.getLogger(__name__)
LINEAR_ATTENTION = "linear_attention"  # the layer type of Gated DeltaNet layers in the configs
_WRAPPED = "_asyncgrpo_tree_recurrence"  # set on each wrapped module: wrap once


@dataclass(frozen=True)
class Level:
    """Segments of one trie depth (in segments): rows start:stop of the layer order, run as one batch
    of the recurrence."""

    start: int
    stop: int
    parent_rows: torch.Tensor  # (B,) row of each segment's parent in the previous level; -1: a root
    cu_seqlens: torch.Tensor  # (B + 1,) int64 segment offsets from `start`, for the varlen kernel
    cu_seqlens_cpu: torch.Tensor  # the same on the host: the kernel plans its chunks with no sync
    # The padded batch of the torch rule (B, Lmax): the row of each slot (a padding slot repeats its
    # segment's first row: finite values that g = beta = 0 keep out of the state), which slots are
    # padding, and the flat slot of each of the level's rows.
    gather: torch.Tensor
    padding: torch.Tensor
    unpad: torch.Tensor


@dataclass(frozen=True)
class RecurrentLayout:
    """What the GDN layers need to know about a packed row, built once per row and shared by every GDN
    layer. A layer computes in *layer order*: the trie's levels one after another (each level's
    segments in packed order), so that every level is a contiguous range of rows and runs on a slice,
    never a gather; `order` maps it to the packed row (None when the two are the same, e.g. a row of
    roots only). The layer gathers its input into that order once and its output back once."""

    num_tokens: int  # real tokens P; the padded row's tail gets zero output
    order: torch.Tensor | None  # (P,) packed index of each row of the layer order; None: the identity
    inverse: torch.Tensor | None  # (P,) layer-order row of each packed token
    conv_index: torch.Tensor  # (P, K) row of the token K-1-j steps back along the path; P = none
    conv_fix_rows: torch.Tensor  # rows whose K-1 predecessors are not simply the rows before them
    # conv_index read the other way, for the convolution kernel's input gradient: the entries
    # r * K + j with conv_index[r, j] = t are conv_successors[conv_successor_offsets[t]:...[t + 1]]
    # (a token at a branch point is read by the first rows of every child segment).
    conv_successor_offsets: torch.Tensor  # (P + 1,)
    conv_successors: torch.Tensor  # (E,)
    segment_cu_seqlens: torch.Tensor  # (G + 1,) every segment's row offsets, in layer order
    segment_cu_seqlens_cpu: torch.Tensor
    segment_predecessors: torch.Tensor  # (G, K-1) conv_index[segment start, :K-1]: its path's tail
    levels: tuple[Level, ...]


def _segment_parents(starts: np.ndarray, subtree_end: np.ndarray) -> np.ndarray:
    """(G,) parent segment of each segment (-1 for roots), from the depth-first layout: the parent
    is the innermost earlier segment whose subtree still contains this segment's start."""
    parents = np.full(len(starts), -1, dtype=np.int64)
    open_segments: list[int] = []
    for s, start in enumerate(starts):
        while open_segments and subtree_end[starts[open_segments[-1]]] <= start:
            open_segments.pop()
        if open_segments:
            parents[s] = open_segments[-1]
        open_segments.append(s)
    return parents


def _packed_conv_index(starts, lengths, parents, num_tokens: int, kernel_size: int) -> np.ndarray:
    """(P, K) packed index of the token K-1-j steps back along each token's path (P: none).

    The predecessor along the path is the previous packed token, except at a segment start, where it
    is the parent's last token (none for a root)."""
    previous = np.arange(num_tokens, dtype=np.int64) - 1
    previous[starts] = np.where(parents >= 0, starts[parents] + lengths[parents] - 1, num_tokens)
    columns = [np.arange(num_tokens, dtype=np.int64)]
    extended = np.append(previous, num_tokens)  # index P (no token) stays P
    for _ in range(kernel_size - 1):
        columns.append(extended[columns[-1]])
    return np.stack(columns[::-1], axis=1)  # column K-1 is the token itself


def recurrent_layout(
    segment_ids: np.ndarray,
    subtree_end: np.ndarray,
    kernel_size: int,
    device: torch.device | str = "cpu",
) -> RecurrentLayout:
    """The layout of one `PackedRow` (its segment_ids and subtree_end arrays) for kernel size K."""
    num_tokens = len(segment_ids)
    if num_tokens == 0:
        raise ValueError("a packed row must hold at least one token")
    starts = np.flatnonzero(np.diff(segment_ids, prepend=-1))  # (G,)
    lengths = np.diff(np.append(starts, num_tokens))
    parents = _segment_parents(starts, subtree_end)
    if np.any((parents >= 0) & (starts[parents] + lengths[parents] > starts)):
        raise ValueError("segments must be laid out depth-first: build rows with asyncgrpo.packing.trie")
    depth = np.zeros(len(starts), dtype=np.int64)
    for s, parent in enumerate(parents):  # parents come before children
        depth[s] = depth[parent] + 1 if parent >= 0 else 0

    # Layer order: segments by depth, then packed position; `first_row` of each segment there.
    by_level = np.lexsort((starts, depth))
    first_row = np.empty_like(starts)
    first_row[by_level] = np.cumsum(lengths[by_level]) - lengths[by_level]
    order = np.repeat(starts[by_level] - first_row[by_level], lengths[by_level]) + np.arange(num_tokens)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(num_tokens)
    packed_conv = _packed_conv_index(starts, lengths, parents, num_tokens, kernel_size)
    conv_index = np.append(inverse, num_tokens)[packed_conv[order]]
    natural = np.arange(num_tokens)[:, None] - np.arange(kernel_size - 1, -1, -1)[None, :]
    natural[natural < 0] = num_tokens  # a plain causal convolution reads zeros before row 0
    identity = bool(np.array_equal(order, np.arange(num_tokens)))
    flat_conv = conv_index.ravel()
    read = np.flatnonzero(flat_conv < num_tokens)
    successor_counts = np.bincount(flat_conv[read], minlength=num_tokens)

    def tensor(array) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(array), device=device)

    segment_cu = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths[by_level])]), dtype=torch.int64)
    row_in_level = np.zeros(len(starts), dtype=np.int64)
    levels = []
    for level in range(int(depth.max()) + 1):
        members = by_level[depth[by_level] == level]  # in packed order
        row_in_level[members] = np.arange(len(members))
        level_lengths = lengths[members]
        level_start = int(first_row[members[0]])
        offsets = np.arange(int(level_lengths.max()))
        real = offsets[None, :] < level_lengths[:, None]
        gather = np.where(real, first_row[members, None] + offsets[None, :], first_row[members, None])
        cu_seqlens = torch.as_tensor(np.concatenate([[0], np.cumsum(level_lengths)]), dtype=torch.int64)
        levels.append(
            Level(
                start=level_start,
                stop=level_start + int(level_lengths.sum()),
                parent_rows=tensor(np.where(parents[members] >= 0, row_in_level[parents[members]], -1)),
                cu_seqlens=cu_seqlens.to(device),
                cu_seqlens_cpu=cu_seqlens,
                gather=tensor(gather),
                padding=tensor(~real),
                unpad=tensor(np.flatnonzero(real)),
            )
        )
    return RecurrentLayout(
        num_tokens=num_tokens,
        order=None if identity else tensor(order),
        inverse=None if identity else tensor(inverse),
        conv_index=tensor(conv_index),
        conv_fix_rows=tensor(np.flatnonzero((conv_index != natural).any(axis=1))),
        conv_successor_offsets=tensor(np.concatenate([[0], np.cumsum(successor_counts)])),
        conv_successors=tensor(read[np.argsort(flat_conv[read], kind="stable")]),
        segment_cu_seqlens=segment_cu.to(device),
        segment_cu_seqlens_cpu=segment_cu,
        segment_predecessors=tensor(conv_index[first_row[by_level], : kernel_size - 1]),
        levels=tuple(levels),
    )


class _PermutedRows(torch.autograd.Function):
    """x[index] followed by zero rows, `num_rows` rows in all, where `index` is a permutation of x's
    first len(index) rows and `inverse` its inverse: the gradient is then a gather too, with no
    scatter (index_put's backward sorts its indices; index_add's uses atomics)."""

    @staticmethod
    def forward(ctx, x, index, inverse, num_rows: int):
        ctx.save_for_backward(inverse)
        ctx.x_rows = x.shape[0]
        out = x.new_empty(num_rows, *x.shape[1:])
        torch.index_select(x, 0, index, out=out[: len(index)])
        out[len(index) :].zero_()
        return out

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        grad_x = grad.new_empty(ctx.x_rows, *grad.shape[1:])
        torch.index_select(grad, 0, inverse, out=grad_x[: len(inverse)])
        grad_x[len(inverse) :].zero_()
        return grad_x, None, None, None


def to_layer_order(packed: torch.Tensor, layout: RecurrentLayout) -> torch.Tensor:
    """The first P rows of a packed-row tensor (L, ...), in the layout's layer order (P, ...)."""
    if layout.order is None:
        return packed[: layout.num_tokens]
    return _PermutedRows.apply(packed, layout.order, layout.inverse, layout.num_tokens)


def to_packed_order(rows: torch.Tensor, layout: RecurrentLayout, num_rows: int) -> torch.Tensor:
    """Rows in layer order (P, ...) back in packed order, zero rows appended up to `num_rows`."""
    if layout.order is None:
        return F.pad(rows, (0, 0) * (rows.dim() - 1) + (0, num_rows - rows.shape[0]))
    return _PermutedRows.apply(rows, layout.inverse, layout.order, num_rows)


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
def _fla_causal_conv1d(device_type: str):
    """fla's varlen causal convolution (Triton) on CUDA when fla-core is installed, else None."""
    if device_type != "cuda":
        return None
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError:
        return None
    return causal_conv1d


def _fla_conv_and_activate(fla_conv, mixed, weight, bias, layout: RecurrentLayout, activation: str):
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
    out, _ = fla_conv(
        mixed[None],
        weight,
        bias,
        initial_state=initial,
        activation=activation,
        cu_seqlens=layout.segment_cu_seqlens,
        cu_seqlens_cpu=layout.segment_cu_seqlens_cpu,
    )
    return out[0]


@functools.cache
def _triton_tree_conv(device_type: str):
    """asyncgrpo's Triton path convolution + SiLU (`packing.tree_conv`) on CUDA when Triton is
    installed (it comes with torch's CUDA builds), else None."""
    if device_type != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    from asyncgrpo.packing.tree_conv import tree_conv_silu  # imports Triton

    return tree_conv_silu


def path_conv_name(device_type: str) -> str:
    """Which path convolution `path_conv_and_activate` runs on a device of this type."""
    if _fla_causal_conv1d(device_type) is not None:
        return "fla's varlen causal_conv1d"
    if _triton_tree_conv(device_type) is not None:
        return "asyncgrpo's Triton kernel"
    return "F.conv1d with segment starts fixed up"


def path_conv_and_activate(mixed, weight, bias, layout: RecurrentLayout, activation: str) -> torch.Tensor:
    """act(depthwise causal convolution along trie paths) of mixed (P, C) in layer order -> (P, C) in
    mixed's dtype. On CUDA one fused kernel: fla's varlen convolution where fla-core is installed (on
    an H200 its backward took half the time of asyncgrpo's own kernel, bench/RESULTS.md), else
    asyncgrpo's Triton kernel; elsewhere `F.conv1d` with the segment starts fixed up."""
    if activation in FUSED_CONV_ACTIVATIONS:
        fla_conv = _fla_causal_conv1d(mixed.device.type)
        if fla_conv is not None:
            return _fla_conv_and_activate(fla_conv, mixed, weight, bias, layout, activation)
        triton_conv = _triton_tree_conv(mixed.device.type)
        if triton_conv is not None:
            return triton_conv(mixed, weight, bias, layout)
    return checkpoint(_plain_conv_and_activate, mixed, weight, bias, layout, activation, use_reentrant=False)


def fla_refusal(device: torch.device) -> str | None:
    """Why fla-core cannot train the gated delta rule on `device`, or None when it can.

    fla-core 0.6 raises in the rule's backward on Hopper (H100, H200) with Triton >= 3.4, < 3.7.1,
    whose code for that kernel gives wrong results (fla issue #640), unless tilelang is installed and
    an nvcc to JIT-compile it is found (fla then runs that one kernel through tilelang; fla's own test
    is `has_usable_nvcc`). Seen on an H200 with Triton 3.6.0 (bench/RESULTS.md).
    """
    import triton  # fla-core's own dependency
    from fla.utils import has_usable_nvcc
    from packaging.version import Version

    version = Version(triton.__version__)
    hopper = torch.cuda.get_device_capability(device)[0] == 9
    if not hopper or not Version("3.4.0") <= version < Version("3.7.1"):
        return None
    if importlib.util.find_spec("tilelang") is not None and has_usable_nvcc():
        return None
    return (
        f"fla-core refuses the gated delta rule's backward on Hopper GPUs with Triton {version} (it computes "
        "wrong gradients there, fla issue #640): upgrade Triton to >= 3.7.1, or `pip install tilelang` "
        "with a CUDA toolkit's nvcc on PATH or in CUDA_HOME"
    )


FAST_PATH_INSTALL = "pip install 'asyncgrpo[gpu]'"  # fla-core, tilelang and what tilelang loads


def torch_rule_reason(device: torch.device) -> str | None:
    """Why Gated DeltaNet layers on `device` run transformers' torch rule instead of fla-core's
    kernels, with what to do about it; None when fla-core's kernels run."""
    if device.type != "cuda":
        return f"fla-core's kernels run on CUDA GPUs only (this device is {device.type})"
    if importlib.util.find_spec("fla") is None:
        return f"fla-core is not installed: `{FAST_PATH_INSTALL}` brings the fast path"
    return fla_refusal(device)


@functools.cache
def _fla_chunk_rule(device: torch.device):
    """fla's varlen chunked gated delta rule for `device`, or None when fla-core is not installed or
    cannot train there (then transformers' torch rule runs: exact, much slower; the trainer says why
    at start-up, `log_gated_delta_rule_path`)."""
    if torch_rule_reason(device) is not None:
        return None
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def gated_delta_rule_path(device: torch.device) -> str:
    """One line: which gated delta rule and convolution tree packing runs on `device` and, on the
    torch fallback, why and what to install."""
    conv = path_conv_name(device.type)
    reason = torch_rule_reason(device)
    if reason is None:
        # fla dispatches some kernels to tilelang where it is installed (on Hopper with Triton < 3.7.1
        # the rule's backward needs it, `fla_refusal`)
        tilelang = "with" if importlib.util.find_spec("tilelang") is not None else "without"
        return (
            f"Gated DeltaNet layers run fla-core's chunked gated delta rule (Triton, {tilelang} tilelang); "
            f"path convolution: {conv}"
        )
    return (
        f"Gated DeltaNet layers run transformers' torch gated delta rule (exact, much slower than fla-core's "
        f"kernels, and it keeps far more activations): {reason}; path convolution: {conv}"
    )


def log_gated_delta_rule_path(
    model: torch.nn.Module, device: torch.device, kernel_cache_dir: str | os.PathLike | None = None
) -> str | None:
    """At start-up, for a model with Gated DeltaNet layers training on `device`: on CUDA, keep fla's
    autotuning results where the next process finds them (`kernel_cache.persist_kernel_autotuning`,
    `kernel_cache_dir` or Triton's cache folder); then log which gated-delta-rule path runs (a warning
    on a GPU where the torch fallback runs). The line, or None for a model without such layers."""
    if not any(is_gated_deltanet(module) for module in model.modules()):
        return None
    kept = persist_kernel_autotuning(kernel_cache_dir) if device.type == "cuda" else None  # before fla loads
    line = gated_delta_rule_path(device) + (f"; kernel autotuning kept in {kept}" if kept else "")
    fallback = device.type == "cuda" and torch_rule_reason(device) is not None
    logger.log(logging.WARNING if fallback else logging.INFO, "%s", line)
    return line


def uses_torch_rule(device: torch.device) -> bool:
    """Whether Gated DeltaNet layers on `device` run transformers' torch rule (CPU, or fla-core missing
    or refusing), which keeps far more activations than fla's kernels (trainer/activation_memory.py)."""
    return device.type != "cuda" or _fla_chunk_rule(device) is None


def tree_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    layout: RecurrentLayout,
    chunk_rule,
) -> torch.Tensor:
    """The gated delta rule over a trie, in the layout's layer order (`to_layer_order`): query/key
    (P, H, Dk), value (P, H, Dv), g/beta (P, H) -> (P, H, Dv). q/k are l2-normalized inside the rule,
    as the models ask. On CUDA fla's varlen kernel runs each level on a slice of the rows when it can;
    otherwise `chunk_rule`, a batched rule with transformers' signature, runs on each level's
    segments padded to the longest (a single-segment level: its slice, unpadded)."""
    fla_rule = _fla_chunk_rule(query.device) if query.is_cuda else None
    outs = []
    parent_states = None
    for depth, level in enumerate(layout.levels):
        # Levels after the first hold only segments with a parent (depth = parent's depth + 1).
        initial = None if parent_states is None else parent_states.index_select(0, level.parent_rows)
        wants_states = depth + 1 < len(layout.levels)
        rows = slice(level.start, level.stop)
        if fla_rule is not None:
            level_out, parent_states = fla_rule(
                *(t[rows][None] for t in (query, key, value, g, beta)),
                initial_state=initial,
                output_final_state=wants_states,
                cu_seqlens=level.cu_seqlens,
                cu_seqlens_cpu=level.cu_seqlens_cpu,
                use_qk_l2norm_in_kernel=True,
            )
            outs.append(level_out[0])
            continue
        batch, slots = level.gather.shape
        if batch == 1:
            q, k, v, gg, bb = (t[rows][None] for t in (query, key, value, g, beta))
        else:
            index = level.gather.flatten()
            q, k, v, gg, bb = (
                t.index_select(0, index).view(batch, slots, *t.shape[1:])
                for t in (query, key, value, g, beta)
            )
            gg, bb = (t.masked_fill(level.padding[..., None], 0) for t in (gg, bb))
        level_out, parent_states = chunk_rule(
            q,
            k,
            v,
            g=gg,
            beta=bb,
            initial_state=initial,
            output_final_state=wants_states,
            use_qk_l2norm_in_kernel=True,
        )
        outs.append(level_out[0] if batch == 1 else level_out.flatten(0, 1).index_select(0, level.unpad))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.to(value.dtype)


def _projections(module, x: torch.Tensor):
    """(mixed q|k|v (P, C), z (P, Hv, Dv), b (P, Hv), a (P, Hv)) of a GDN module, per model family."""
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: interleaved per key-head group
        query, key, value, z, b, a = module.fix_query_key_value_ordering(
            module.in_proj_qkvz(x[None]), module.in_proj_ba(x[None])
        )
        mixed = torch.cat([t.reshape(1, t.shape[1], -1) for t in (query, key, value)], dim=-1)
        return mixed[0], z[0], b[0], a[0]
    projections = (module.in_proj_qkv, module.in_proj_z, module.in_proj_b, module.in_proj_a)
    if all(_plain_linear(p) for p in projections):
        # One matmul instead of four: x is cast for autocast once, b and a (a few columns each) stop
        # being matmuls of their own, and x's gradient comes out of one matmul instead of four summed.
        out = F.linear(x, torch.cat([p.weight for p in projections]))
        mixed, z, b, a = torch.split(out, [p.out_features for p in projections], dim=-1)
    else:  # adapters, hooks, biases or quantized layers: each module as the model calls it
        mixed, z, b, a = (p(x) for p in projections)
    return mixed, z.reshape(x.shape[0], -1, module.head_v_dim), b, a


def _plain_linear(module: torch.nn.Module) -> bool:
    """A bare `nn.Linear` without bias or hooks: its forward is `F.linear(x, weight)` and nothing else."""
    return (
        type(module) is torch.nn.Linear
        and module.bias is None
        and not module._forward_hooks
        and not module._forward_pre_hooks
    )


@torch.compiler.disable  # see the module doc (Compilation)
def tree_gdn_forward(module, hidden_states: torch.Tensor, layout: RecurrentLayout) -> torch.Tensor:
    """A GDN module's forward over a packed row (1, L, D) -> (1, L, D); tokens past P get zeros. Runs
    in the layout's layer order between one gather of its input and one of its output."""
    if hidden_states.shape[0] != 1:
        raise ValueError(f"a packed row is one sequence (batch 1), got batch {hidden_states.shape[0]}")
    x = to_layer_order(hidden_states[0], layout)
    mixed, z, b, a = _projections(module, x)
    mixed = path_conv_and_activate(
        mixed, module.conv1d.weight.squeeze(1), module.conv1d.bias, layout, module.activation
    )
    query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    num_tokens = x.shape[0]
    query = query.reshape(num_tokens, -1, module.head_k_dim)
    key = key.reshape(num_tokens, -1, module.head_k_dim)
    value = value.reshape(num_tokens, -1, module.head_v_dim)
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    groups = module.num_v_heads // module.num_k_heads
    if groups > 1:
        query = query.repeat_interleave(groups, dim=1)
        key = key.repeat_interleave(groups, dim=1)
    # transformers' own torch rule: its module-level name may be wrapped to dispatch to fla, which is
    # exactly what the padded path runs for when fla is missing or refuses (see `fla_refusal`).
    chunk_rule = inspect.unwrap(sys.modules[type(module).__module__].torch_chunk_gated_delta_rule)
    core = tree_gated_delta_rule(query, key, value, g, beta, layout, chunk_rule)  # (P, Hv, Dv)
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    out = module.out_proj(core.reshape(num_tokens, -1))
    return to_packed_order(out, layout, hidden_states.shape[1])[None]


def _dispatching_forward(module, original, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    if isinstance(attention_mask, RecurrentLayout):
        if cache_params is not None:
            raise ValueError("a tree-packed forward runs without a cache: pass use_cache=False")
        return tree_gdn_forward(module, hidden_states, attention_mask)
    return original(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)


def is_gated_deltanet(module: torch.nn.Module) -> bool:
    """A Gated DeltaNet token mixer this module can tree-pack (Qwen3.5 / Qwen3-Next layouts)."""
    has_projections = hasattr(module, "in_proj_qkv") or hasattr(module, "in_proj_qkvz")
    return has_projections and all(hasattr(module, n) for n in ("conv1d", "A_log", "dt_bias", "norm"))


def enable_tree_recurrence(model: torch.nn.Module) -> int:
    """Wrap every GDN module of `model` so a `RecurrentLayout` mask runs the tree path; returns how
    many modules it found. Idempotent."""
    count = 0
    for module in model.modules():
        if not is_gated_deltanet(module):
            continue
        count += 1
        if getattr(module, _WRAPPED, False):
            continue
        module.forward = functools.partial(_dispatching_forward, module, module.forward)
        setattr(module, _WRAPPED, True)
    return count
