"""MoE experts as two grouped GEMMs in the compute dtype, for transformers' fused experts modules
(Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next: weights stored as 3-D `gate_up_proj` (E, 2I, H) and `down_proj`
(E, H, I)).

transformers' default experts path ("grouped_mm") runs torch's grouped GEMM only where the weights are
already bf16: the trainer keeps fp32 weights under bf16 autocast and compiles the decoder layers,
where transformers falls back to a loop of fp32 matmuls, one expert after another (its
`grouped_mm_fallback`). Here, under autocast, the token-expert pairs are sorted by expert once, the
weights are cast to the autocast dtype once per call, and each projection is one `grouped_mm` over
all experts; the routing weights and the sum over a token's experts follow in the same dtype as
transformers' path. Gradients flow through torch's grouped GEMM backward. Anything else (no autocast
and fp32 weights, biases, transposed or interleaved weights, expert parallelism) runs transformers'
own grouped path unchanged. Measured: bench/gpu_step_moe.py, docs/gpu-performance.md, "MoE experts".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward

GROUPED_EXPERTS = "asyncgrpo_grouped"  # the name registered in transformers' ExpertsInterface
_TRANSFORMERS_DEFAULT = "grouped_mm"  # the implementation transformers picks for such modules


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x (S, K) @ weight[e].T for the rows of each expert e; weight (E, N, K), rows grouped by
    `offsets` (E,) int32, the end row of each expert's group."""
    grouped = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return grouped(x, weight.transpose(1, 2), offs=offsets)


def _compute_dtype(module, hidden_states: torch.Tensor) -> torch.dtype:
    device = hidden_states.device.type
    if torch.is_autocast_enabled(device):  # the weights are cast as autocast casts nn.Linear's
        return torch.get_autocast_dtype(device)
    return module.gate_up_proj.dtype


def _fast_path(module, hidden_states: torch.Tensor) -> bool:
    """Grouped GEMMs apply: bf16 compute (autocast, or bf16 weights) of a plain gated experts module."""
    return (
        hidden_states.device.type in ("cuda", "cpu")
        and _compute_dtype(module, hidden_states) == torch.bfloat16
        and getattr(module, "has_gate", False)
        and not getattr(module, "has_bias", False)
        and not getattr(module, "is_transposed", False)
        and getattr(module, "is_concatenated", True)
        and not getattr(module, "_is_expert_parallel", False)
    )


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int):
    """(order, tokens, offsets) of the flat token-expert pairs: `order` sorts the pairs by expert
    (stable), `tokens` is each sorted pair's token, `offsets` the end of each expert's group (int32)."""
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order, order // top_k_index.shape[-1], torch.cumsum(counts, 0, dtype=torch.int32)


def grouped_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts of (T, H) tokens routed to `top_k_index` (T, K) with `top_k_weights` (T, K)."""
    if not _fast_path(self, hidden_states):
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return _grouped_experts(
        self, hidden_states, top_k_index, top_k_weights, _compute_dtype(self, hidden_states)
    )


@torch.compiler.disable  # eager inside compiled layers: torch's grouped GEMM as it is (graph break)
def _grouped_experts(module, hidden_states, top_k_index, top_k_weights, dtype: torch.dtype) -> torch.Tensor:
    num_tokens, top_k = top_k_index.shape
    order, tokens, offsets = sort_by_expert(top_k_index, module.num_experts)
    x = hidden_states.to(dtype)[tokens]  # (S, H): the tokens of each expert, expert after expert
    up = _grouped_mm(x, module.gate_up_proj.to(dtype), offsets)  # (S, 2I)
    out = _grouped_mm(module._apply_gate(up), module.down_proj.to(dtype), offsets)  # (S, H)
    out = out * top_k_weights.reshape(-1)[order].to(dtype)[:, None]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return out[inverse].view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


ALL_EXPERTS_FUNCTIONS.register(GROUPED_EXPERTS, grouped_experts_forward)


def use_grouped_experts(model: torch.nn.Module) -> bool:
    """Switch a model whose experts run transformers' default grouped path to `grouped_experts_forward`
    (in place, PEFT-wrapped models too); True when switched. A model without fused experts modules,
    or whose experts implementation a user chose, is left as it is."""
    for module in model.modules():
        if hasattr(module, "set_experts_implementation") and module._can_set_experts_implementation():
            has_experts = any(getattr(m, "gate_up_proj", None) is not None for m in module.modules())
            if has_experts and module.config._experts_implementation == _TRANSFORMERS_DEFAULT:
                module.set_experts_implementation(GROUPED_EXPERTS)
                return True
            return False
    return False
