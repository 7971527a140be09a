"""Checkpoint only the decoder layers a row needs to fit (`gradient_checkpointing_to_fit`, CUDA default).

Checkpointing every layer recomputes the whole forward in backward: about a third more work per
step, for memory that a 16k-32k-token row of a 1-2B model does not need on a large GPU. Before each
row, `CheckpointToFit.before_row` estimates what the row's activations would take with no layer
checkpointed, compares it with the GPU memory still available, and checkpoints just enough leading
layers (transformers' per-layer `gradient_checkpointing` flag) for the rest to fit; a row too long
for that is checkpointed everywhere, as before.

The estimate is per token and per layer, from the model's shape: what a compiled decoder layer keeps
for backward (the fp32 residual stream under autocast, the bf16 inputs of its matmuls, q/k/v, the
attention output and the MLP's gate/up/activation), times a safety factor; bench/gpu_step.py
measures the peak memory it leads to. Gated DeltaNet layers that run transformers' torch rule (where
fla-core cannot train, see docs/models.md) keep far more: the rule's fp32 chunk intermediates and one
recurrent state per 64-token chunk, ~160 KB per token per layer at the Qwen3.5-2B shape; without that
term the default step ran out of memory on an H200 (bench/RESULTS.md).
"""

from __future__ import annotations

import torch

from asyncgrpo.packing.gated_deltanet import LINEAR_ATTENTION, uses_torch_rule

# Covers allocator fragmentation and what the estimate leaves out (flex attention's scratch). Not
# calibrated kernel by kernel: on an H200 (Qwen3-1.7B shape, fp32 weights + AdamW) rows of 16k-262k
# tokens all fit with it, the fullest at 124 GB peak of 139 GiB (bench/RESULTS.md, gpu_step).
SAFETY_FACTOR = 1.25
# Memory kept free beyond the estimate: the fused head's chunk workspace, the block masks, cuBLAS
# workspaces. A fraction of the card's memory, at least 4 GiB.
RESERVE_FRACTION = 0.08
MIN_RESERVE_BYTES = 4 << 30
ADAMW_STATE_BYTES_PER_PARAM = 8  # two fp32 moments


def layer_bytes_per_token(config) -> tuple[float, float]:
    """(bytes per token a layer keeps when not checkpointed, bytes when checkpointed: its input)."""
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = getattr(config, "num_key_value_heads", config.num_attention_heads) * head_dim
    intermediate = config.intermediate_size
    residual = 4 * hidden  # fp32 residual stream (fp32 weights under bf16 autocast)
    kept = 2 * residual + 2 * (hidden + 2 * q + 2 * kv + 3 * intermediate) + 4 * config.num_attention_heads
    return SAFETY_FACTOR * kept, float(residual)


# transformers' torch gated delta rule, per token and value head, in fp32 values kept for backward:
# ~15 vectors of the head dim, the chunk's recurrent state (Dk x Dv) shared by its 64 tokens, ~5 rows
# of the 64 x 64 chunk matrices. Fitted to the bytes autograd saves for that rule on CPU at head dims
# 32, 64 and 128 (tests/test_activation_memory.py measures them).
TORCH_RULE_CHUNK = 64
TORCH_RULE_VECTORS_PER_HEAD_DIM = 15
TORCH_RULE_CHUNK_ROWS = 5


def torch_rule_bytes_per_token(config) -> float:
    """Bytes per token a Gated DeltaNet layer keeps for backward when transformers' torch rule runs."""
    key_dim, value_dim = config.linear_key_head_dim, config.linear_value_head_dim
    per_head = (
        TORCH_RULE_VECTORS_PER_HEAD_DIM * max(key_dim, value_dim)
        + key_dim * value_dim / TORCH_RULE_CHUNK
        + TORCH_RULE_CHUNK_ROWS * TORCH_RULE_CHUNK
    )
    return 4.0 * config.linear_num_value_heads * per_head


def per_layer_bytes_per_token(config, torch_rule: bool) -> tuple[list[float], float]:
    """(bytes per token each layer keeps when not checkpointed, bytes when checkpointed: its input).
    `torch_rule`: the Gated DeltaNet layers run transformers' torch rule, not fla-core."""
    kept, checkpointed = layer_bytes_per_token(config)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    extra = SAFETY_FACTOR * torch_rule_bytes_per_token(config) if torch_rule else 0.0
    return [kept + (extra if kind == LINEAR_ATTENTION else 0.0) for kind in layer_types], checkpointed


def layers_to_checkpoint(
    num_tokens: int, kept_per_token: list[float], input_per_token: float, available_bytes: float
) -> int:
    """The fewest leading layers to checkpoint so that the row's activations fit `available_bytes`
    (all of them when nothing fits).

    With the first k layers checkpointed a row keeps the other layers' activations and k layer inputs,
    plus, while a checkpointed layer is recomputed in backward, that layer's full activations (the
    largest of the k).
    """

    def need(k: int) -> float:
        recomputed = max(kept_per_token[:k], default=0.0)
        return num_tokens * (sum(kept_per_token[k:]) + k * input_per_token + recomputed)

    return next(
        (k for k in range(len(kept_per_token) + 1) if need(k) <= available_bytes), len(kept_per_token)
    )


class CheckpointToFit:
    """Sets each decoder layer's `gradient_checkpointing` flag before a row, see the module doc."""

    def __init__(self, layers, config, params: list[torch.nn.Parameter], optimizer, device: torch.device):
        self.layers = layers
        torch_rule = getattr(config, "linear_num_value_heads", None) is not None and uses_torch_rule(device)
        self.kept_per_token, self.input_per_token = per_layer_bytes_per_token(config, torch_rule)
        self.params = params
        self.optimizer = optimizer
        self.device = device

    @classmethod
    def for_training(cls, model, optimizer, args, distributed: bool) -> CheckpointToFit | None:
        """The policy when it applies: gradient checkpointing on and to fit, one process on CUDA, and
        layers that carry transformers' per-layer flag. None otherwise: every layer is checkpointed
        (or none), exactly as `gradient_checkpointing` says."""
        if not (args.gradient_checkpointing and args.gradient_checkpointing_to_fit) or distributed:
            return None
        device = next(model.parameters()).device
        layers = getattr(model.get_decoder(), "layers", None)
        # transformers' checkpointing layers, with checkpointing enabled (Trainer.train does that)
        flagged = layers and all(hasattr(layer, "_gradient_checkpointing_func") for layer in layers)
        if device.type != "cuda" or not flagged:
            return None
        params = [p for p in model.parameters() if p.requires_grad]
        return cls(list(layers), model.config.get_text_config(), params, optimizer, device)

    def available_bytes(self) -> float:
        """Free GPU memory (the driver's free plus the allocator's cached but unused), less what the
        step will still allocate: gradients not yet created and optimizer states not yet built."""
        free, total = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        pending = sum(p.numel() * p.element_size() for p in self.params if p.grad is None)
        state = getattr(self.optimizer, "state", {})
        pending += sum(p.numel() * ADAMW_STATE_BYTES_PER_PARAM for p in self.params if p not in state)
        reserve = max(MIN_RESERVE_BYTES, RESERVE_FRACTION * total)
        return free + cached - pending - reserve

    def before_row(self, num_tokens: int) -> int:
        """Flag the layers for a row of `num_tokens` packed tokens; returns how many are checkpointed."""
        k = layers_to_checkpoint(
            num_tokens, self.kept_per_token, self.input_per_token, self.available_bytes()
        )
        for index, layer in enumerate(self.layers):
            layer.gradient_checkpointing = index < k
        return k
