"""Model FLOPs of a packed training step and the training device's peak, for `perf/*_mfu`.

Model FLOPs (no recomputation counted) of one forward+backward:
  6 x (decoder matmul parameters) per forwarded token
  + 6 x V x H per loss entry (the output head runs only where a token is trained)
  + 12 x layers x heads x head_dim per attended query-key pair (QK^T and AV, forward and backward)
  + for Gated DeltaNet hybrids (Qwen3.5): 18 x value heads x key dim x value dim per token and
    linear-attention layer, the recurrence's three state products (read k^T S, write k delta^T,
    read q^T S, 2 FLOPs each, x3 for backward); only the full-attention layers attend pairs.
Only architectures whose parameter layout this formula matches are supported; for the others, and
when the device's peak is unknown, MFU is not logged: a guessed figure would mislead more than none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

GATED_DELTANET_HYBRIDS = ("qwen3_5_text",)
SUPPORTED_MODEL_TYPES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen3_vl",
    "qwen3_vl_text",
    "mistral",
) + GATED_DELTANET_HYBRIDS

# Dense bf16/fp16 tensor-core peaks (FLOP/s), by a substring of torch.cuda.get_device_name().
_PEAK_BF16 = (
    ("H200", 989.4e12),
    ("H100", 989.4e12),
    ("H800", 989.4e12),
    ("GH200", 989.4e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("L4", 121e12),
)


@dataclass(frozen=True)
class FlopModel:
    decoder_params: int  # matmul parameters active per token (attention + MLP projections)
    head_params: int  # V x H
    attention_flops_per_pair: int  # 12 x attention layers x heads x head_dim
    recurrent_flops_per_token: int = 0  # Gated DeltaNet state products, forward + backward

    def step_flops(self, forwarded_tokens: int, loss_entries: int, attention_pairs: int) -> float:
        return (
            (6.0 * self.decoder_params + self.recurrent_flops_per_token) * forwarded_tokens
            + 6.0 * self.head_params * loss_entries
            + float(self.attention_flops_per_pair) * attention_pairs
        )


def flop_model(model: torch.nn.Module) -> FlopModel | None:
    config = model.config.get_text_config()
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return None
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", heads) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    layers = config.num_hidden_layers
    if config.model_type in GATED_DELTANET_HYBRIDS:
        return _hybrid_flop_model(config, hidden, heads, kv_heads, head_dim)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o and k, v projections
    experts = getattr(config, "num_experts", None)
    if experts:
        per_expert = 3 * hidden * config.moe_intermediate_size
        mlp = per_expert * config.num_experts_per_tok + hidden * experts  # active experts + router
    else:
        mlp = 3 * hidden * config.intermediate_size  # gate, up, down
    return FlopModel(
        decoder_params=layers * (attention + mlp),
        head_params=config.vocab_size * hidden,
        attention_flops_per_pair=12 * layers * heads * head_dim,
    )


def _hybrid_flop_model(config, hidden: int, heads: int, kv_heads: int, head_dim: int) -> FlopModel:
    """Qwen3.5: 3 of 4 layers Gated DeltaNet, every layer a dense MLP."""
    full = config.layer_types.count("full_attention")
    linear = config.layer_types.count("linear_attention")
    attention = hidden * head_dim * (3 * heads + 2 * kv_heads)  # q + its output gate, o, k, v
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_heads = config.linear_num_value_heads
    value_dim = value_heads * config.linear_value_head_dim
    # in_proj_qkv, in_proj_z, in_proj_b + in_proj_a, out_proj
    mixer = (
        hidden * (2 * key_dim + value_dim)
        + hidden * value_dim
        + 2 * hidden * value_heads
        + value_dim * hidden
    )
    mlp = 3 * hidden * config.intermediate_size
    state = value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    return FlopModel(
        decoder_params=full * attention + linear * mixer + (full + linear) * mlp,
        head_params=config.vocab_size * hidden,
        attention_flops_per_pair=12 * full * heads * head_dim,
        recurrent_flops_per_token=18 * linear * state,
    )


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak at the training precision; `ASYNCGRPO_PEAK_TFLOPS` overrides."""
    override = os.environ.get("ASYNCGRPO_PEAK_TFLOPS")
    if override:
        return float(override) * 1e12
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in _PEAK_BF16:
        if key in name:
            return peak
    return None
