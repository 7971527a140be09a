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

import torch
import torch.nn.functional as F

from asyncgrpo.packing.kernel_cache import persist_kernel_autotuning
from asyncgrpo.packing.kernel_choice import gated_norm_choice
from asyncgrpo.packing.path_conv import path_conv_and_activate, path_conv_name
from asyncgrpo.packing.recurrent_layout import RecurrentLayout, to_layer_order, to_packed_order

logger = logging.getLogger(__name__)
LINEAR_ATTENTION = "linear_attention"  # the layer type of Gated DeltaNet layers in the configs
_WRAPPED = "_asyncgrpo_tree_recurrence"  # set on each wrapped module: wrap once
# The models' gated RMS norms (all the same function: weight * x / rms(x) * silu(gate), eps in
# `variance_epsilon`), which the fused kernel (`packing.gated_norm`) may replace.
GATED_RMS_NORMS = ("Qwen3_5RMSNormGated", "Qwen3_5MoeRMSNormGated", "Qwen3NextRMSNormGated")


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
    """One line: which gated delta rule, convolution and gated norm tree packing runs on `device` and,
    on the torch fallback, why and what to install."""
    norm = {"triton": "asyncgrpo's Triton kernel", "model": "the model's module"}[
        gated_norm_choice(device.type)
    ]
    conv = f"{path_conv_name(device.type)}; gated norm: {norm}"
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
    inputs = (query, key, value, g, beta)
    # Each input's level slices, from one split: its backward writes the whole gradient in one pass
    # (a slice's backward would write a zero tensor of the whole size per level, then add them).
    sizes = [level.stop - level.start for level in layout.levels]
    per_level = list(zip(*(torch.split(t, sizes) for t in inputs))) if len(sizes) > 1 else [inputs]
    outs = []
    parent_states = None
    for depth, level in enumerate(layout.levels):
        # Levels after the first hold only segments with a parent (depth = parent's depth + 1).
        initial = None if parent_states is None else parent_states.index_select(0, level.parent_rows)
        wants_states = depth + 1 < len(layout.levels)
        if fla_rule is not None:
            level_out, parent_states = fla_rule(
                *(t[None] for t in per_level[depth]),
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
            q, k, v, gg, bb = (t[None] for t in per_level[depth])
        else:
            index = level.gather.flatten()
            q, k, v, gg, bb = (t.index_select(0, index).view(batch, slots, *t.shape[1:]) for t in inputs)
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
    query, key, value = path_conv_and_activate(
        mixed, module.conv1d.weight.squeeze(1), module.conv1d.bias, layout, module.activation,
        (module.key_dim, module.key_dim, module.value_dim),
    )  # fmt: skip
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
    out = module.out_proj(gated_norm(module.norm, core, z).reshape(num_tokens, -1))
    return to_packed_order(out, layout, hidden_states.shape[1])[None]


def gated_norm(norm: torch.nn.Module, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The layer's gated RMS norm of core (P, Hv, Dv) with gate z (P, Hv, Dv): the fused kernel on CUDA
    for the models' own norm modules (`packing.kernel_choice.gated_norm_choice`), else the module."""
    if type(norm).__name__ in GATED_RMS_NORMS and gated_norm_choice(core.device.type) == "triton":
        from asyncgrpo.packing.gated_norm import gated_rms_norm  # imports Triton: CUDA only

        return gated_rms_norm(core, z, norm.weight, norm.variance_epsilon)
    return norm(core.reshape(-1, core.shape[-1]), z.reshape(-1, core.shape[-1]))


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
