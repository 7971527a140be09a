"""MoE experts as grouped GEMMs (`asyncgrpo.kernels.moe_experts`) against transformers' loop over the
experts: values and the gradients of the tokens, the routing weights and both weight tensors, in bf16
(autocast over fp32 weights, as the trainer runs) no further from the fp32 loop than the bf16 loop is;
experts that get no token; which models the trainer switches."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from asyncgrpo.kernels.moe_experts import GROUPED_EXPERTS, sort_by_expert, use_grouped_experts

TINY = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, vocab_size=64)  # fmt: skip
# Qwen3-30B-A3B's experts (its public config.json)
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, num_hidden_layers=1, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, vocab_size=1024)  # fmt: skip


def moe_model(shape: dict, device: str) -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, dtype="float32"))
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, shape["hidden_size"] ** -0.5)
        experts.down_proj.normal_(0, shape["moe_intermediate_size"] ** -0.5)
    return model


def run_experts(model, implementation: str, inputs, autocast: bool) -> list[torch.Tensor]:
    """Output and the gradients of hidden states, routing weights, gate_up_proj and down_proj."""
    model.set_experts_implementation(implementation)
    experts = model.model.layers[0].mlp.experts
    hidden, index, weights, grad = (t.clone() for t in inputs)
    hidden.requires_grad_(), weights.requires_grad_()
    experts.zero_grad()
    device = hidden.device.type
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        out = experts(hidden, index, weights)
    out.float().backward(grad)
    return [
        out.detach().float(),
        hidden.grad,
        weights.grad,
        experts.gate_up_proj.grad,
        experts.down_proj.grad,
    ]


def routing(num_tokens: int, num_experts: int, top_k: int, device: str, unused: int = 0):
    """Random (hidden, top-k index, weights, output gradient); the last `unused` experts get no token."""
    gen = torch.Generator(device=device).manual_seed(1)
    scores = torch.rand(num_tokens, num_experts, generator=gen, device=device)
    scores[:, num_experts - unused :] = -1
    weights, index = scores.topk(top_k, dim=-1)
    return index, torch.softmax(weights, -1)


def check_against_loop(shape: dict, num_tokens: int, device: str) -> dict:
    model = moe_model(shape, device)
    index, weights = routing(num_tokens, shape["num_experts"], shape["num_experts_per_tok"], device, unused=2)
    gen = torch.Generator(device=device).manual_seed(2)
    hidden = torch.randn(num_tokens, shape["hidden_size"], generator=gen, device=device)
    inputs = (hidden, index, weights, torch.randn(hidden.shape, generator=gen, device=device))
    exact = run_experts(model, "eager", inputs, autocast=False)
    loop = run_experts(model, "eager", inputs, autocast=True)
    grouped = run_experts(model, GROUPED_EXPERTS, inputs, autocast=True)
    names = ("out", "d hidden", "d routing weights", "d gate_up_proj", "d down_proj")
    errors = {}
    for name, want, bf16_loop, ours in zip(names, exact, loop, grouped):
        loop_error = float((bf16_loop - want).norm() / want.norm())
        our_error = float((ours - want).norm() / want.norm())
        errors[name] = (our_error, loop_error)
        assert our_error <= 2 * loop_error + 1e-3, (name, our_error, loop_error)
    unused = model.model.layers[0].mlp.experts.gate_up_proj.grad[-2:]
    assert (unused == 0).all(), "an expert without tokens got a gradient"
    return errors


def test_grouped_experts_match_the_loop_within_bf16_error():
    """CPU, bf16 autocast (torch's grouped GEMM runs there too): the grouped path against transformers'
    loop over the experts, both against the fp32 loop."""
    print(check_against_loop(TINY, 40, "cpu"))


def test_sort_by_expert_groups_pairs_by_expert():
    index = torch.tensor([[2, 0], [0, 3], [2, 1]])
    order, tokens, offsets = sort_by_expert(index, 5)
    assert index.reshape(-1)[order].tolist() == [0, 0, 1, 2, 2, 3]
    assert tokens.tolist() == [0, 1, 2, 0, 2, 1]
    assert offsets.tolist() == [2, 3, 5, 6, 6]  # expert 4: no pair, an empty group


def test_only_moe_models_on_transformers_default_are_switched():
    moe = moe_model(TINY, "cpu")
    assert use_grouped_experts(moe) and moe.config._experts_implementation == GROUPED_EXPERTS
    moe.set_experts_implementation("eager")
    assert not use_grouped_experts(moe)  # a user's choice stays
    dense = Qwen3ForCausalLM(
        Qwen3Config(**{k: v for k, v in TINY.items() if "expert" not in k and "moe" not in k})
    )
    assert not use_grouped_experts(dense)


@pytest.mark.gpu
def test_cuda_grouped_experts_match_the_loop_at_qwen3_30b_a3b_shape():
    """CUDA, Qwen3-30B-A3B's experts (128 of 2048 x 768, 8 a token), 2,048 tokens, bf16 autocast over
    fp32 weights."""
    print(check_against_loop(QWEN3_30B_A3B, 2048, "cuda"))
