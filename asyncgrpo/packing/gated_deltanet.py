"""Tree packing for Gated DeltaNet layers (Qwen3.5, Qwen3.6, Qwen3-Next linear-attention layers).

A Gated DeltaNet layer mixes tokens in two places, and neither is attention, so a BlockMask cannot
express a packed trie to it:
- a short causal depthwise convolution (kernel K = 4) over the projected q/k/v channels: here
  each token reads its own K - 1 predecessors along its path in the trie (`conv_index`), never
  the tokens that merely precede it in the packed row;
- the chunked gated delta rule, a recurrence over a (key dim x value dim) state per head: here
  each trie segment starts from the final state of its parent segment. A prompt's state is
  computed once and handed to every completion under it; segments of the same depth in the trie
  (a "level") run as one batch, level by level.

Both are exact rewrites of forwarding each sample alone: the same arithmetic in the same order per
token, up to the chunk boundaries of the recurrence (fp32 round-off).

How it plugs in: `enable_tree_recurrence(model)` wraps each GDN module's forward. The packed forward
passes a `RecurrentLayout` as the mask of the "linear_attention" layer type (see
`tree_attention.tree_attention_masks`); the wrapper then runs the tree path. Any other call
(generation, a plain forward) goes to the model's own forward unchanged.

Kernels: on CUDA with `fla-core` installed (extra `gpu`), the recurrence of a level runs as one
varlen `chunk_gated_delta_rule` call (`cu_seqlens`, per-sequence `initial_state`) with no padding;
otherwise the model module's own chunked rule (transformers' torch reference, or fla when
transformers found it) runs on the level's segments padded to the longest. Right padding with
g = 0 and beta = 0 leaves the state untouched, so the padded final state is the segment's own.

Dtypes follow the model's own forward: the convolution's output is cast back to the dtype of the
projection that fed it (bf16 under autocast), so the recurrence sees what it sees unpacked.

Compilation: the tree mixer runs eagerly inside a compiled decoder layer (`torch.compiler.disable`):
the layout carries per-row Python ints (level count, lengths) that would make dynamo recompile the
layer for every new row, and fla's kernels are opaque to it anyway. The rest of the layer (norms,
MLP) stays compiled.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers.activations import ACT2FN

logger = logging.getLogger(__name__)
LINEAR_ATTENTION = "linear_attention"  # the layer type of Gated DeltaNet layers in the configs
_WRAPPED = "_asyncgrpo_tree_recurrence"  # set on each wrapped module: wrap once


@dataclass(frozen=True)
class Level:
    """Segments of one trie depth (in segments), run as one batch of the recurrence."""

    starts: torch.Tensor  # (B,) packed index of each segment's first token
    lengths: torch.Tensor  # (B,)
    parent_rows: torch.Tensor  # (B,) row of the parent segment in the previous level; -1: root
    gather: torch.Tensor  # (B, Lmax) packed index of each padded slot; num_tokens for padding
    max_length: int
    index: torch.Tensor  # (N,) packed index of the level's tokens, segment after segment (varlen)
    cu_seqlens: torch.Tensor  # (B + 1,) int64 segment offsets in `index`, for the varlen kernel
    cu_seqlens_cpu: torch.Tensor  # the same on the host: the kernel plans its chunks with no sync


@dataclass(frozen=True)
class RecurrentLayout:
    """What the GDN layers need to know about a packed row: each token's convolution inputs and the
    trie's segments grouped by depth. Built once per row, shared by every GDN layer."""

    num_tokens: int  # real tokens P; the padded row's tail gets zero output
    conv_index: torch.Tensor  # (P, K) packed index of the token K-1-j steps back; P = before the start
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

    # Predecessor along the path: the previous packed token, except at a segment start, where it is
    # the parent's last token (none for a root).
    previous = np.arange(num_tokens, dtype=np.int64) - 1
    previous[starts] = np.where(parents >= 0, starts[parents] + lengths[parents] - 1, num_tokens)
    columns = [np.arange(num_tokens, dtype=np.int64)]
    extended = np.append(previous, num_tokens)  # index P (no token) stays P
    for _ in range(kernel_size - 1):
        columns.append(extended[columns[-1]])
    conv_index = np.stack(columns[::-1], axis=1)  # (P, K): column K-1 is the token itself

    depth = np.zeros(len(starts), dtype=np.int64)
    for s, parent in enumerate(parents):  # parents come before children
        depth[s] = depth[parent] + 1 if parent >= 0 else 0
    row_in_level = np.zeros(len(starts), dtype=np.int64)
    levels = []
    for level in range(int(depth.max()) + 1):
        members = np.flatnonzero(depth == level)
        row_in_level[members] = np.arange(len(members))
        level_lengths = lengths[members]
        max_length = int(level_lengths.max())
        offsets = np.arange(max_length)
        gather = starts[members, None] + offsets[None, :]
        gather = np.where(offsets[None, :] < level_lengths[:, None], gather, num_tokens)
        parent_rows = np.where(parents[members] >= 0, row_in_level[parents[members]], -1)
        cu_seqlens = torch.as_tensor(np.concatenate([[0], np.cumsum(level_lengths)]), dtype=torch.int64)
        levels.append(
            Level(
                starts=torch.as_tensor(starts[members], device=device),
                lengths=torch.as_tensor(level_lengths, device=device),
                parent_rows=torch.as_tensor(parent_rows, device=device),
                gather=torch.as_tensor(gather, device=device),
                max_length=max_length,
                index=torch.as_tensor(gather[offsets[None, :] < level_lengths[:, None]], device=device),
                cu_seqlens=cu_seqlens.to(device),
                cu_seqlens_cpu=cu_seqlens,
            )
        )
    return RecurrentLayout(num_tokens, torch.as_tensor(conv_index, device=device), tuple(levels))


def tree_causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_index: torch.Tensor
) -> torch.Tensor:
    """Depthwise causal convolution along trie paths: x (P, C), weight (C, K) -> (P, C).

    out[t] = bias + sum_j weight[:, j] * x[conv_index[t, j]], a missing predecessor reading zero;
    the same terms as `F.conv1d(..., padding=K - 1)` on the sample alone. One (P, C) gather per tap,
    never a (P, K, C) tensor.
    """
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])]).to(weight.dtype)
    out = padded[conv_index[:, 0]] * weight[:, 0]
    for j in range(1, weight.shape[1]):
        out = out + padded[conv_index[:, j]] * weight[:, j]
    if bias is not None:
        out = out + bias
    return out


def _convolve_and_activate(mixed, weight, bias, conv_index, activation: str) -> torch.Tensor:
    """act(path convolution) in the projection's dtype (bf16 under autocast, as unpacked). Run under
    `checkpoint`: backward recomputes it from `mixed` instead of keeping its K gathered fp32 copies
    (at 16k tokens and 6,144 channels, 1.6 GB per layer)."""
    return ACT2FN[activation](tree_causal_conv1d(mixed, weight, bias, conv_index)).to(mixed.dtype)


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


@functools.cache
def _fla_chunk_rule(device: torch.device):
    """fla's varlen chunked gated delta rule for `device`, or None when fla-core is not installed or
    cannot train there (then transformers' torch rule runs: exact, much slower; we say why once)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    reason = fla_refusal(device)
    if reason is not None:
        logger.warning(
            "Gated DeltaNet tree packing runs transformers' torch rule instead of fla-core: %s", reason
        )
        return None
    return chunk_gated_delta_rule


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
    """The gated delta rule over a trie: query/key (P, H, Dk), value (P, H, Dv), g/beta (P, H) ->
    (P, H, Dv). q/k are l2-normalized inside the rule, as the models ask. `chunk_rule` is a batched
    rule with transformers' signature (padded path); on CUDA fla's varlen kernel is used when it can."""
    fla_rule = _fla_chunk_rule(query.device) if query.is_cuda else None
    out = value.new_zeros(layout.num_tokens + 1, *value.shape[1:])  # row P: padding slots land here
    parent_states = None
    for level in layout.levels:
        # Levels after the first hold only segments with a parent (depth = parent's depth + 1).
        initial = None if parent_states is None else parent_states[level.parent_rows]
        if fla_rule is not None:
            index = level.index
            level_out, parent_states = fla_rule(
                query[index][None],
                key[index][None],
                value[index][None],
                g[index][None],
                beta[index][None],
                initial_state=initial,
                output_final_state=True,
                cu_seqlens=level.cu_seqlens,
                cu_seqlens_cpu=level.cu_seqlens_cpu,
                use_qk_l2norm_in_kernel=True,
            )
            out = out.index_copy(0, index, level_out[0].to(out.dtype))
            continue
        gather = level.gather  # (B, Lmax)
        q, k, v, gg, bb = (
            torch.cat([t, t.new_zeros(1, *t.shape[1:])])[gather] for t in (query, key, value, g, beta)
        )
        level_out, parent_states = chunk_rule(
            q,
            k,
            v,
            g=gg,
            beta=bb,
            initial_state=initial,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        out = out.index_put((gather,), level_out.to(out.dtype), accumulate=True)
    return out[: layout.num_tokens]


def _projections(module, x: torch.Tensor):
    """(mixed q|k|v (P, C), z (P, Hv, Dv), b (P, Hv), a (P, Hv)) of a GDN module, per model family."""
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: interleaved per key-head group
        query, key, value, z, b, a = module.fix_query_key_value_ordering(
            module.in_proj_qkvz(x[None]), module.in_proj_ba(x[None])
        )
        mixed = torch.cat([t.reshape(1, t.shape[1], -1) for t in (query, key, value)], dim=-1)
        return mixed[0], z[0], b[0], a[0]
    z = module.in_proj_z(x).reshape(x.shape[0], -1, module.head_v_dim)
    return module.in_proj_qkv(x), z, module.in_proj_b(x), module.in_proj_a(x)


@torch.compiler.disable  # see the module doc (Compilation)
def tree_gdn_forward(module, hidden_states: torch.Tensor, layout: RecurrentLayout) -> torch.Tensor:
    """A GDN module's forward over a packed row (1, L, D) -> (1, L, D); tokens past P get zeros."""
    if hidden_states.shape[0] != 1:
        raise ValueError(f"a packed row is one sequence (batch 1), got batch {hidden_states.shape[0]}")
    x = hidden_states[0, : layout.num_tokens]
    mixed, z, b, a = _projections(module, x)
    mixed = checkpoint(
        _convolve_and_activate,
        mixed,
        module.conv1d.weight.squeeze(1),
        module.conv1d.bias,
        layout.conv_index,
        module.activation,
        use_reentrant=False,
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
    padding = out.new_zeros(hidden_states.shape[1] - num_tokens, out.shape[-1])
    return torch.cat([out, padding])[None]


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
