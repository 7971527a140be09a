"""Model FLOPs of a Gated DeltaNet hybrid: the formula counts exactly the matmul weights the model has."""

import torch

from asyncgrpo.cli.tiny_model import build_model, build_tokenizer
from asyncgrpo.modeling.perf import flop_model


def test_qwen3_5_flop_model_counts_its_matmuls():
    model = build_model(build_tokenizer(), arch="qwen3_5")
    config = model.config
    flops = flop_model(model)
    decoder_matmuls = sum(
        m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)
    )
    assert flops.decoder_params == decoder_matmuls
    assert flops.head_params == model.lm_head.weight.numel()
    full = config.layer_types.count("full_attention")
    linear = config.layer_types.count("linear_attention")
    assert full == 1 and linear == 2  # the tiny model: two GDN layers, then attention
    assert flops.attention_flops_per_pair == 12 * 1 * 4 * 32  # 1 attention layer, 4 heads of 32
    state = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    assert flops.recurrent_flops_per_token == 18 * linear * state
    expected = (6 * decoder_matmuls + 18 * linear * state) * 10 + 6 * flops.head_params * 3 + 1536 * 7
    assert flops.step_flops(forwarded_tokens=10, loss_entries=3, attention_pairs=7) == expected
