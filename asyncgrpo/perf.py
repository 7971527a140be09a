"""Model FLOPs of a packed training step and the training device's peak, for `perf/*_mfu`.

Model FLOPs (no recomputation counted) of one forward+backward:
  6 x (decoder matmul parameters) per forwarded token
  + 6 x V x H per loss entry (the output head runs only where a token is trained)
  + 12 x layers x heads x head_dim per attended query-key pair (QK^T and AV, forward and backward).
Only architectures whose parameter layout this formula matches are supported; for the others, and
when the device's peak is unknown, MFU is not logged: a guessed figure would mislead more than none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_text", "mistral")

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
    attention_flops_per_pair: int  # 12 x layers x heads x head_dim

    def step_flops(self, forwarded_tokens: int, loss_entries: int, attention_pairs: int) -> float:
        return (
            6.0 * self.decoder_params * forwarded_tokens
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
