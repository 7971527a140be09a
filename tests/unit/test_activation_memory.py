"""Checkpoint-to-fit's memory estimate: which layers to checkpoint (hand-derived), and the Gated DeltaNet
torch rule's term against the bytes autograd really keeps for that rule."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncgrpo.trainer.activation_memory import (
    SAFETY_FACTOR,
    TORCH_RULE_STEP_FACTOR,
    RowMemoryPlan,
    layer_bytes_per_token,
    layers_to_checkpoint,
    per_layer_bytes_per_token,
    plan_row,
    torch_rule_bytes_per_token,
)


def test_no_layer_is_checkpointed_when_the_row_fits():
    # 3 layers of 10 bytes a token, 100 tokens: 3,000 bytes.
    assert layers_to_checkpoint(100, [10.0, 10.0, 10.0], 2.0, 3_000) == 0


def test_the_fewest_leading_layers_that_fit():
    # k checkpointed: 100 x (10 (3 - k) + 2 k + 10) -> k=1: 3,200, k=2: 2,400, k=3: 1,600.
    assert layers_to_checkpoint(100, [10.0, 10.0, 10.0], 2.0, 2_999) == 2
    assert layers_to_checkpoint(100, [10.0, 10.0, 10.0], 2.0, 2_400) == 2
    assert layers_to_checkpoint(100, [10.0, 10.0, 10.0], 2.0, 2_399) == 3
    assert layers_to_checkpoint(100, [10.0, 10.0, 10.0], 2.0, 10) == 3  # nothing fits: all of them


def test_uneven_layers_count_the_largest_recomputed_one():
    # A heavy first layer (50) then two of 10, 100 tokens: k=0 keeps 70 a token; k=1 keeps 20 + 2 and
    # the heavy layer again while it is recomputed (72: no saving); k=2: 10 + 4 + 50; k=3: 6 + 50.
    assert layers_to_checkpoint(100, [50.0, 10.0, 10.0], 2.0, 7_000) == 0
    assert layers_to_checkpoint(100, [50.0, 10.0, 10.0], 2.0, 6_999) == 2
    assert layers_to_checkpoint(100, [50.0, 10.0, 10.0], 2.0, 6_399) == 3


def test_the_head_keeps_its_logits_when_that_recomputes_less():
    # 3 layers of 10 bytes a token, input 2, 100 tokens (as above: k=0 needs 3,000, k=1 3,200, k=2
    # 2,400, k=3 1,600); 40 entries of 5 logit bytes: keeping them takes 200 bytes. A layer's forward
    # costs 1 FLOP a token (100 a layer), the head's matmul `head` FLOPs an entry (40 x head).
    def plan(available: float, head: float) -> RowMemoryPlan:
        return plan_row(100, 40, [10.0] * 3, 2.0, available, 5.0, 1.0, head)

    assert plan(3_200, 10.0) == RowMemoryPlan(0, True)  # everything fits
    # 3,000: without the logits no layer; with them 2 layers (200 FLOPs) against the head's 400
    assert plan(3_000, 10.0) == RowMemoryPlan(2, True)
    assert plan(3_000, 2.0) == RowMemoryPlan(0, False)  # the head's 80 FLOPs are cheaper
    assert plan(3_000, 5.0) == RowMemoryPlan(2, True)  # a tie keeps them: 200 against 200
    # 1,700: every layer checkpointed (1,600) fits, but not with the logits (1,500 left)
    assert plan(1_700, 1e9) == RowMemoryPlan(3, False)
    assert plan(10, 1.0) == RowMemoryPlan(3, False)  # nothing fits: all layers, as before


def gdn_config(heads: int, head_dim: int):
    return SimpleNamespace(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_value_heads=heads,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
    )


def test_only_gated_deltanet_layers_running_the_torch_rule_get_its_term():
    config = gdn_config(4, 64)
    kept, checkpointed = layer_bytes_per_token(config)
    assert per_layer_bytes_per_token(config, torch_rule=False) == ([kept] * 4, checkpointed)
    with_rule, _ = per_layer_bytes_per_token(config, torch_rule=True)
    extra = SAFETY_FACTOR * TORCH_RULE_STEP_FACTOR * torch_rule_bytes_per_token(config)
    assert with_rule == [kept + extra] * 3 + [kept]


def saved_bytes_of_the_torch_rule(length: int, heads: int, head_dim: int) -> int:
    """What autograd keeps for backward of transformers' torch gated delta rule (distinct storages)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    generator = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=generator).requires_grad_()

    query, key, value = (leaf(1, length, heads, head_dim) for _ in range(3))
    decay = (-torch.rand(1, length, heads, generator=generator)).requires_grad_()
    beta = torch.rand(1, length, heads, generator=generator).requires_grad_()
    storages = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        torch_chunk_gated_delta_rule(
            query, key, value, g=decay, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
    return sum(storages.values())


@pytest.mark.parametrize("heads,head_dim", [(2, 32), (4, 64), (2, 128)])
def test_the_torch_rule_term_covers_what_autograd_keeps(heads, head_dim):
    length = 512
    measured = saved_bytes_of_the_torch_rule(length, heads, head_dim) / length
    estimate = torch_rule_bytes_per_token(gdn_config(heads, head_dim))
    print(f"heads {heads} x dim {head_dim}: measured {measured:.0f} B/token, estimate {estimate:.0f}")
    assert measured <= estimate * 1.02 and estimate <= 1.1 * measured
