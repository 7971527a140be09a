"""Tree attention: one attention call over a packed prefix-trie row, through FlexAttention.

A `PackedRow` lets packed index `q` attend to packed index `kv` iff `kv <= q < subtree_end[kv]`
(ancestor segments and causal); sliding-window layers add `position[q] - position[kv] < window`.
That rule is a FlexAttention `mask_mod` turned into a block-sparse `BlockMask`.
`enable_tree_attention(model)` plugs it into transformers; every other call keeps SDPA. How it plugs
in, why rows are padded and captured tensors kept at a fixed capacity (compilation), and the CPU
backward: docs/architecture.md#tree-attention-inside-transformers. On CUDA, masks without a sliding
window also carry the row's `TreeLayout`, and layers without softcapping run asyncgrpo's own kernels
over it instead of flex (`packing/tree_attention_kernel.py`; `kernel_choice.tree_attention_choice`):
docs/gpu-performance.md, "Tree attention".
"""

from __future__ import annotations

import functools
import re

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.packing.gated_deltanet import LINEAR_ATTENTION, enable_tree_recurrence, is_gated_deltanet
from asyncgrpo.packing.kernel_choice import tree_attention_choice
from asyncgrpo.packing.recurrent_layout import RecurrentLayout, recurrent_layout
from asyncgrpo.packing.tree_tiles import TreeLayout

TREE_ATTENTION = "asyncgrpo_tree"  # the name registered in transformers' AttentionInterface
BLOCK_SIZE = 128  # FlexAttention's default sparse block: rows are padded to a multiple of it
# FlexAttention kernel options per device type; absent: torch's defaults for the device. On CUDA the
# kernels load their blocks through the tensor memory accelerator where the GPU has one (Hopper on;
# flex falls back where it cannot use it): faster tree attention on an H200, and no tile shape beat
# torch's defaults (bench/tree_attention_kernels.py; figures in docs/gpu-performance.md).
FLEX_KERNEL_OPTIONS: dict[str, dict] = {"cuda": {"USE_TMA": True}}
_MIN_CAPACITY = 4096
# The mask's sliding window, stored on the BlockMask so that each layer can check it got the mask
# built for its own window (a model that ignores the {layer type: mask} dict would otherwise give
# a sliding layer the full mask silently).
_WINDOW_ATTR = "asyncgrpo_sliding_window"
# The row's TreeLayout, on masks the CUDA kernels run (no sliding window): the BlockMask still goes
# through transformers' mask preparation, which passes BlockMasks on untouched.
_LAYOUT_ATTR = "asyncgrpo_tree_layout"
# Layer types that are attention over the sequence with a causal (optionally windowed) mask.
_PACKABLE_LAYER_TYPES = {"full_attention", "sliding_attention"}
# Token mixers that are not attention: recurrent state would have to be forked per trie branch
# (done for Gated DeltaNet layers, see gated_deltanet.py; refused for the others).
_RECURRENT_MODULE = re.compile(
    r"Mamba|DeltaNet|ShortConv|RWKV|Recurrent|Lightning|LinearAttention|Rglru", re.IGNORECASE
)

# Compiled once per process (per mask/score variant), for all row lengths: why the rows and captured
# tensors are shaped as they are, docs/architecture.md#tree-attention-inside-transformers.
_compiled_flex_attention = torch.compile(flex_attention, dynamic=True)
_compiled_create_block_mask = torch.compile(create_block_mask, dynamic=True)
# Variants (full / window / softcap x grad / no grad x device) can pass dynamo's default limit of 8
# compiled versions per function, past which it silently runs flex eagerly (dense scores, slow).
_RECOMPILE_LIMIT = 64


def padded_length(num_tokens: int) -> int:
    """Row length after padding to a multiple of BLOCK_SIZE, and to at least two blocks."""
    return max(2, -(-num_tokens // BLOCK_SIZE)) * BLOCK_SIZE


def _capacity(length: int) -> int:
    """Fixed size of the tensors a mask_mod reads: changes (and recompiles) only past 4096, 8192..."""
    return max(_MIN_CAPACITY, 1 << (length - 1).bit_length())


def build_tree_block_mask(
    subtree_end: torch.Tensor,
    position_ids: torch.Tensor,
    sliding_window: int | None = None,
    layout: TreeLayout | None = None,
) -> BlockMask:
    """The BlockMask of a packed row, over its padded length `padded_length(P)`.

    subtree_end, position_ids: (P,) int64, the row's own (unpadded) arrays, on the device the
    attention runs on. Padding token i (P <= i < padded length) attends only to itself, and no real
    token sees a padding token: padding never produces NaN and never changes a real token's output.
    layout: the row's `TreeLayout`, carried for asyncgrpo's kernels (which give padding zero output);
    only without a sliding window.
    """
    if subtree_end.ndim != 1 or subtree_end.shape != position_ids.shape:
        raise ValueError(
            f"subtree_end {tuple(subtree_end.shape)} and position_ids {tuple(position_ids.shape)} must be "
            "1-D of the same length: pass one PackedRow's arrays, not a batch"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    num_tokens = subtree_end.shape[0]
    index = torch.arange(num_tokens, device=subtree_end.device)
    valid = ((subtree_end > index) & (subtree_end <= num_tokens)).all()
    message = "subtree_end[i] must lie in (i, P]: build rows with asyncgrpo.packing.trie.pack_row"
    if subtree_end.device.type == "cpu":
        if num_tokens and not bool(valid):
            raise ValueError(message)
    else:  # checked on the device: reading the answer back would make the host wait for the GPU
        torch._assert_async(valid, message)
    length = padded_length(num_tokens)
    capacity = _capacity(length)
    device = subtree_end.device

    ends = torch.arange(1, capacity + 1, device=device)  # padding i: subtree end i + 1 -> itself only
    ends[:num_tokens] = subtree_end
    torch._dynamo.mark_static(ends, 0)  # a dynamic captured size breaks the CPU kernel (see above)
    if sliding_window is None:

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx < ends[kv_idx])

    else:
        positions = torch.zeros(capacity, dtype=torch.int64, device=device)
        positions[:num_tokens] = position_ids
        torch._dynamo.mark_static(positions, 0)
        window = int(sliding_window)

        def mask_mod(b, h, q_idx, kv_idx):
            tree = (kv_idx <= q_idx) & (q_idx < ends[kv_idx])
            return tree & (positions[q_idx] - positions[kv_idx] < window)

    with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
        mask = _compiled_create_block_mask(
            mask_mod, None, None, length, length, device=device, BLOCK_SIZE=BLOCK_SIZE
        )
    setattr(mask, _WINDOW_ATTR, sliding_window)
    if layout is not None:
        if sliding_window is not None:
            raise ValueError("the tree-attention kernels have no sliding window: pass layout=None")
        setattr(mask, _LAYOUT_ATTR, layout)
    return mask


def tree_layout(subtree_end: torch.Tensor | np.ndarray, device: torch.device | str) -> TreeLayout:
    """The `TreeLayout` of a row for the kernels on `device`; from the host array when given one (a
    device tensor is read back, which waits for the GPU)."""
    host = subtree_end if isinstance(subtree_end, np.ndarray) else subtree_end.cpu().numpy()
    return TreeLayout(host, padded_length(len(host)), torch.device(device))


def layer_windows(config) -> dict[str, int | None]:
    """{layer type: sliding window or None} of a text config, for `tree_attention_masks`.

    Models with per-layer `layer_types` (Gemma 2/3, Qwen2/3, gpt-oss...) pick a mask per layer type
    from a dict; models without it (Mistral) apply `config.sliding_window` to every layer.
    """
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        if not getattr(config, "use_sliding_window", True):
            window = None
        return {"full_attention": window}
    return {
        t: window if t == "sliding_attention" else None
        for t in dict.fromkeys(layer_types)
        if t != LINEAR_ATTENTION
    }


def tree_attention_masks(
    config,
    subtree_end: torch.Tensor,
    position_ids: torch.Tensor,
    segment_ids: torch.Tensor | None = None,
    host_subtree_end: np.ndarray | None = None,
) -> BlockMask | dict[str, BlockMask | RecurrentLayout]:
    """What to pass as the model's `attention_mask` for one row: one BlockMask, or a dict
    {layer type: BlockMask} when the model has sliding-window layers, plus, for models with
    Gated DeltaNet layers, {"linear_attention": RecurrentLayout} (which needs `segment_ids`).
    On CUDA the masks without a window carry the row's TreeLayout for the kernels, built from
    `host_subtree_end` (the row's host array: no wait for the GPU) when given."""
    windows = layer_windows(config)
    layout = None
    if None in windows.values() and tree_attention_choice(subtree_end.device.type) == "triton":
        layout = tree_layout(
            subtree_end if host_subtree_end is None else host_subtree_end, subtree_end.device
        )
        _prepare_tiles(layout, config)
    masks = {
        t: build_tree_block_mask(subtree_end, position_ids, w, layout if w is None else None)
        for t, w in windows.items()
    }
    if LINEAR_ATTENTION in (getattr(config, "layer_types", None) or []):
        if segment_ids is None:
            raise ValueError("a model with linear-attention layers needs the row's segment_ids for its masks")
        masks[LINEAR_ATTENTION] = recurrent_layout(
            segment_ids.cpu().numpy(),
            subtree_end.cpu().numpy(),
            config.linear_conv_kernel_dim,
            device=subtree_end.device,
        )
    if len(masks) == 1 and "full_attention" in masks:
        return masks["full_attention"]
    return masks


def _prepare_tiles(layout: TreeLayout, config) -> None:
    """Build the layout's tile lists for the model's attention heads now, under autocast (bf16) and
    without (fp32): a compiled layer then finds them ready and only reads tensors."""
    from asyncgrpo.packing.tree_attention_kernel import tile_sizes  # imports Triton

    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    groups = heads // (getattr(config, "num_key_value_heads", None) or heads)
    for dtype in (torch.bfloat16, torch.float32):
        layout.tiles(*tile_sizes(head_dim, groups, dtype))


@functools.cache
def _softcap_score_mod(softcap: float, device: torch.device):
    """Gemma-2 attention-logit softcapping. Cached: the same function object for the same cap, so
    the compiled kernel is not re-traced. The cap is a 0-d tensor: with dynamic shapes a captured
    Python float becomes a symbolic scalar that the CPU flex lowering fails on (unbacked_bindings)."""
    cap = torch.tensor(softcap, dtype=torch.float32, device=device)

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return score_mod


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_mask: BlockMask,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of query (B, Hq, L, D) over key/value (B, Hkv, L, D) -> (B, Hq, L, Dv).

    Hq must be a multiple of Hkv (grouped-query attention); L = the BlockMask's length.
    """
    if scale is None:
        scale = query.shape[-1] ** -0.5
    layout = getattr(block_mask, _LAYOUT_ATTR, None)
    if layout is not None and softcap is None:
        query, key, value = _common_dtype(query, key, value)
        return _kernel_attention(query, key, value, layout, scale)
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if needs_grad and query.device.type == "cpu":
        return _FlexForwardBlockwiseBackward.apply(query, key, value, block_mask, scale, softcap)
    if needs_grad:
        return _flex(query, key, value, block_mask, scale, softcap)
    # No gradient wanted: detach, since flex refuses CPU inputs that require grad even under no_grad.
    return _flex(query.detach(), key.detach(), value.detach(), block_mask, scale, softcap)


def _common_dtype(query, key, value):
    """q, k, v in one dtype for the kernels: autocast's where it is on (a model's q/k norms can
    return fp32 beside a bf16 v), else the query's."""
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    return query.to(dtype), key.to(dtype), value.to(dtype)


def _kernel_attention(query, key, value, layout: TreeLayout, scale: float) -> torch.Tensor:
    """asyncgrpo's kernels, as torch operators: a compiled layer keeps them in its graph."""
    from asyncgrpo.packing.tree_attention_kernel import tree_attention_kernel  # imports Triton

    return tree_attention_kernel(query, key, value, layout, scale)


def _flex(query, key, value, block_mask: BlockMask, scale: float, softcap: float | None) -> torch.Tensor:
    score_mod = None if softcap is None else _softcap_score_mod(float(softcap), query.device)
    kwargs = {"score_mod": score_mod, "block_mask": block_mask, "scale": scale, "enable_gqa": True,
              "kernel_options": FLEX_KERNEL_OPTIONS.get(query.device.type)}  # fmt: skip
    if torch.compiler.is_compiling():  # inside a compiled model: let its compiler trace flex
        return flex_attention(query, key, value, **kwargs)
    with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
        return _compiled_flex_attention(query, key, value, **kwargs)


class _FlexForwardBlockwiseBackward(torch.autograd.Function):
    """CPU training: compiled flex forward, blockwise plain-torch backward (flex has none on CPU)."""

    @staticmethod
    def forward(ctx, query, key, value, block_mask, scale, softcap):
        ctx.save_for_backward(query, key, value)
        ctx.block_mask, ctx.scale, ctx.softcap = block_mask, scale, softcap
        return _flex(query.detach(), key.detach(), value.detach(), block_mask, scale, softcap)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value = ctx.saved_tensors
        grads = _blockwise_attention_backward(
            query, key, value, grad_out, ctx.block_mask, ctx.scale, ctx.softcap
        )
        return (*grads, None, None, None)


def _blockwise_attention_backward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    grad_out: torch.Tensor,
    block_mask: BlockMask,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of masked (softcapped) attention, one 128-query block at a time.

    Each query block recomputes its probabilities over the key blocks the BlockMask lists for it
    (partial and full blocks), so the work and memory follow the mask's sparsity, never (L, L).
    """
    batch, num_heads, length, head_dim = query.shape
    num_kv_heads = key.shape[1]
    groups = num_heads // num_kv_heads
    q_block, kv_block = block_mask.BLOCK_SIZE
    assert length % q_block == 0 and block_mask.kv_num_blocks.shape[:2] == (1, 1), "masks from this module"
    dtype = torch.float32  # accumulate in fp32 whatever the model dtype
    q = query.to(dtype).view(batch, num_kv_heads, groups, length, head_dim)
    k, v = key.to(dtype), value.to(dtype)  # (B, Hkv, L, D)
    do = grad_out.to(dtype).view(batch, num_kv_heads, groups, length, -1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    kv_offsets = torch.arange(kv_block, device=query.device)
    num_blocks = block_mask.kv_num_blocks[0, 0].tolist()
    full_blocks = (
        block_mask.full_kv_num_blocks[0, 0].tolist() if block_mask.full_kv_num_blocks is not None else None
    )
    zero = torch.zeros((), dtype=torch.int64, device=query.device)
    for i in range(length // q_block):
        blocks = block_mask.kv_indices[0, 0, i, : num_blocks[i]]
        if full_blocks is not None:
            blocks = torch.cat([blocks, block_mask.full_kv_indices[0, 0, i, : full_blocks[i]]])
        cols = (blocks[:, None] * kv_block + kv_offsets).flatten()  # (C,) key indices this block sees
        rows = slice(i * q_block, (i + 1) * q_block)
        q_idx = torch.arange(rows.start, rows.stop, device=query.device)
        allowed = block_mask.mask_mod(zero, zero, q_idx[:, None], cols[None, :])  # (Bq, C)

        qi, doi = q[:, :, :, rows], do[:, :, :, rows]  # (B, Hkv, G, Bq, D)
        kc, vc = k[:, :, cols], v[:, :, cols]  # (B, Hkv, C, D)
        scores = torch.einsum("bhgqd,bhcd->bhgqc", qi, kc) * scale
        if softcap is not None:
            capped = torch.tanh(scores / softcap)
            scores = softcap * capped
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)  # each row sees itself
        dv.index_add_(2, cols, torch.einsum("bhgqc,bhgqd->bhcd", probs, doi))
        dprobs = torch.einsum("bhgqd,bhcd->bhgqc", doi, vc)
        dscores = probs * (dprobs - (probs * dprobs).sum(-1, keepdim=True))
        if softcap is not None:
            dscores = dscores * (1 - capped * capped)
        dq[:, :, :, rows] = torch.einsum("bhgqc,bhcd->bhgqd", dscores, kc) * scale
        dk.index_add_(2, cols, torch.einsum("bhgqc,bhgqd->bhcd", dscores, qi) * scale)
    dq = dq.view(batch, num_heads, length, head_dim)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: BlockMask | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query (B, Hq, L, D) -> output (B, L, Hq, D), no weights."""
    if not isinstance(attention_mask, BlockMask):  # an ordinary forward: exactly SDPA
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, s_aux=s_aux, **kwargs
        )
    if s_aux is not None:
        raise ConfigurationError(f"{TREE_ATTENTION} attention does not support attention sinks (gpt-oss)")
    if dropout:
        raise ConfigurationError(
            f"{TREE_ATTENTION} attention has no dropout: set config.attention_dropout = 0"
        )
    mask_window = getattr(attention_mask, _WINDOW_ATTR, None)
    if mask_window != sliding_window:
        raise ConfigurationError(
            f"layer {getattr(module, 'layer_idx', '?')} has sliding_window={sliding_window} but got a "
            f"mask built for {mask_window}: pass tree_attention_masks(config, ...), which builds one mask "
            "per layer type"
        )
    if softcap is None:  # models that read the cap from the config instead of passing it
        softcap = getattr(getattr(module, "config", None), "attn_logit_softcapping", None)
    out = tree_attention(query, key, value, attention_mask, scale=scaling, softcap=softcap)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)
AttentionMaskInterface.register(TREE_ATTENTION, sdpa_mask)  # for ordinary (non-packed) forwards


# What a refusal tells the user: there is no untree-packed path to fall back on.
CANNOT_TRAIN = (
    "asyncgrpo trains every model through tree packing, so it cannot train this one yet (the families it "
    "trains, and what each needs: docs/models.md)"
)


def _text_config(model: PreTrainedModel):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_tree_packable(model: PreTrainedModel) -> None:
    """Raise ValueError naming what in `model` tree attention cannot run, and what to do."""
    config = _text_config(model)
    sinks = [name for name, _ in model.named_parameters() if name.rsplit(".", 1)[-1] == "sinks"]
    if sinks or getattr(config, "model_type", "") == "gpt_oss":
        raise ConfigurationError(
            f"{type(model).__name__} has attention sinks ({sinks[0] if sinks else 'gpt_oss'}), which tree "
            "attention does not implement yet: " + CANNOT_TRAIN
        )
    for layer_type in dict.fromkeys(getattr(config, "layer_types", None) or []):
        if layer_type == LINEAR_ATTENTION and any(is_gated_deltanet(m) for m in model.modules()):
            continue  # Gated DeltaNet: packed by gated_deltanet.py
        if layer_type not in _PACKABLE_LAYER_TYPES:
            raise ConfigurationError(
                f"{type(model).__name__} has '{layer_type}' layers; tree packing supports full and "
                "sliding-window attention and Gated DeltaNet layers (Mamba / other linear-attention / other "
                "token mixers are not supported yet): " + CANNOT_TRAIN
            )
    gated_deltanets = [name for name, module in model.named_modules() if is_gated_deltanet(module)]
    for name, module in model.named_modules():
        if any(name == g or name.startswith(g + ".") for g in gated_deltanets):
            continue
        if _RECURRENT_MODULE.search(type(module).__name__):
            raise ConfigurationError(
                f"{type(model).__name__} has a {type(module).__name__} layer ({name}); tree packing "
                "supports only attention layers (recurrent / linear-attention layers are not supported "
                "yet): " + CANNOT_TRAIN
            )
    windows = layer_windows(config)
    if "sliding_attention" in windows and windows["sliding_attention"] is None:
        raise ConfigurationError(
            "config has 'sliding_attention' layers but no sliding_window: fix the model config"
        )
    if getattr(config, "attention_dropout", 0.0):
        raise ConfigurationError(
            f"tree attention has no attention dropout (config.attention_dropout={config.attention_dropout}): "
            "set it to 0"
        )


def enable_tree_attention(model: PreTrainedModel) -> PreTrainedModel:
    """Switch `model` to tree attention (in place; returns it). Sliding-window layers and attention
    softcapping are handled per layer, Gated DeltaNet layers by gated_deltanet.py; models it cannot
    pack are refused with a ValueError."""
    check_tree_packable(model)
    enable_tree_recurrence(model)
    model.set_attn_implementation(TREE_ATTENTION)
    if _text_config(model)._attn_implementation != TREE_ATTENTION:
        raise ConfigurationError(
            f"{type(model).__name__} cannot switch its attention implementation (its attention does not go "
            "through transformers' AttentionInterface): " + CANNOT_TRAIN
        )
    return model
