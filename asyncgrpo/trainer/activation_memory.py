"""Checkpoint only the decoder layers a row needs to fit (`gradient_checkpointing_to_fit`, CUDA default).

Before each row, `CheckpointToFit.before_row` estimates from the model's shape what the row's
activations would take with no layer checkpointed, compares it with the GPU memory still available,
and checkpoints just enough leading layers for the rest to fit (all of them for a row too long). The
same plan decides whether the fused head keeps the row's logits for backward, whichever recomputes
fewer FLOPs. What the estimate counts and how it was checked against measurements:
docs/gpu-performance.md#how-checkpoint-to-fit-estimates-a-row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncgrpo.packing.gated_deltanet import LINEAR_ATTENTION, uses_torch_rule

# Covers allocator fragmentation and part of what the estimate leaves out (flex attention's scratch,
# the head's chunk workspace). Not calibrated kernel by kernel, and thinner than its name: the reserve
# below covers the rest (measured rows against the estimate: the docs page the module doc names).
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
# 32, 64 and 128 (tests/unit/test_activation_memory.py measures them).
TORCH_RULE_CHUNK = 64
TORCH_RULE_VECTORS_PER_HEAD_DIM = 15
TORCH_RULE_CHUNK_ROWS = 5
# In a training step on a GPU a Gated DeltaNet layer running that rule keeps more than the rule alone:
# autocast's fp32 copies of its inputs, tree packing's layout gathers (gated_deltanet.py) and the
# layer's own projections and convolution, which the generic per-layer term does not model. This
# factor was measured on an H200 at the Qwen3.5-2B shape (the docs page the module doc names);
# without it the default step ran out of memory.
TORCH_RULE_STEP_FACTOR = 2.2


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
    extra = SAFETY_FACTOR * TORCH_RULE_STEP_FACTOR * torch_rule_bytes_per_token(config) if torch_rule else 0.0
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


@dataclass(frozen=True)
class RowMemoryPlan:
    checkpointed_layers: int  # leading decoder layers to checkpoint
    keep_logits: bool  # the fused head keeps the (E, V) logits for backward


def plan_row(
    num_tokens: int,
    num_entries: int,
    kept_per_token: list[float],
    input_per_token: float,
    available_bytes: float,
    logits_bytes_per_entry: float,
    layer_flops_per_token: float,
    head_flops_per_entry: float,
) -> RowMemoryPlan:
    """Checkpointed layers and whether to keep the head's logits, whichever recomputes fewer FLOPs
    (a checkpointed layer: its forward again, `layer_flops_per_token` a token; recomputed logits:
    `head_flops_per_entry` an entry) among the plans that fit `available_bytes`. Ties keep the
    logits (no recomputation either way: keeping them is the faster backward)."""

    def fits(k: int, budget: float) -> bool:
        recomputed = max(kept_per_token[:k], default=0.0)
        return num_tokens * (sum(kept_per_token[k:]) + k * input_per_token + recomputed) <= budget

    recompute = RowMemoryPlan(
        layers_to_checkpoint(num_tokens, kept_per_token, input_per_token, available_bytes), False
    )
    keep_budget = available_bytes - num_entries * logits_bytes_per_entry
    keep = RowMemoryPlan(layers_to_checkpoint(num_tokens, kept_per_token, input_per_token, keep_budget), True)
    if not fits(keep.checkpointed_layers, keep_budget):
        return recompute
    keep_flops = keep.checkpointed_layers * layer_flops_per_token * num_tokens
    recompute_flops = (
        recompute.checkpointed_layers * layer_flops_per_token * num_tokens
        + head_flops_per_entry * num_entries
    )
    return keep if keep_flops <= recompute_flops else recompute


class CheckpointToFit:
    """Sets each decoder layer's `gradient_checkpointing` flag before a row and says whether the head
    keeps its logits (docs/gpu-performance.md#how-checkpoint-to-fit-estimates-a-row)."""

    def __init__(
        self,
        layers,
        config,
        params: list[torch.nn.Parameter],
        optimizer,
        device: torch.device,
        head_weight: torch.Tensor,
        compute_bytes: int,
    ):
        self.layers = layers
        torch_rule = getattr(config, "linear_num_value_heads", None) is not None and uses_torch_rule(device)
        self.kept_per_token, self.input_per_token = per_layer_bytes_per_token(config, torch_rule)
        self.params = params
        self.optimizer = optimizer
        self.device = device
        vocab, hidden = head_weight.shape
        self.logits_bytes_per_entry = float(vocab * compute_bytes)
        self.head_flops_per_entry = 2.0 * vocab * hidden
        # A checkpointed layer's forward again: 2 FLOPs per weight and token (attention scores aside).
        self.layer_flops_per_token = (
            2.0 * sum(p.numel() for p in torch.nn.ModuleList(layers).parameters()) / len(layers)
        )

    @classmethod
    def for_training(cls, model, optimizer, args, distributed: bool) -> CheckpointToFit | None:
        """The policy when it applies: gradient checkpointing on and to fit, one process on CUDA, and
        layers that carry transformers' per-layer flag. None otherwise: every layer is checkpointed
        (or none), exactly as `gradient_checkpointing` says, and the head recomputes its logits."""
        if not (args.gradient_checkpointing and args.gradient_checkpointing_to_fit) or distributed:
            return None
        device = next(model.parameters()).device
        layers = getattr(model.get_decoder(), "layers", None)
        # transformers' checkpointing layers, with checkpointing enabled (Trainer.train does that)
        flagged = layers and all(hasattr(layer, "_gradient_checkpointing_func") for layer in layers)
        if device.type != "cuda" or not flagged:
            return None
        params = [p for p in model.parameters() if p.requires_grad]
        head_weight = model.get_output_embeddings().weight
        compute_bytes = 2 if args.bf16 or args.fp16 else head_weight.element_size()
        return cls(
            list(layers),
            model.config.get_text_config(),
            params,
            optimizer,
            device,
            head_weight,
            compute_bytes,
        )

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

    def before_row(self, num_tokens: int, num_entries: int) -> RowMemoryPlan:
        """Flag the layers for a row of `num_tokens` packed tokens and `num_entries` trained entries;
        returns the plan (how many layers are checkpointed, whether the head keeps its logits)."""
        plan = plan_row(
            num_tokens,
            num_entries,
            self.kept_per_token,
            self.input_per_token,
            self.available_bytes(),
            self.logits_bytes_per_entry,
            self.layer_flops_per_token,
            self.head_flops_per_entry,
        )
        for index, layer in enumerate(self.layers):
            layer.gradient_checkpointing = index < plan.checkpointed_layers
        return plan
