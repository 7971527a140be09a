"""Model families: tiny builders, image-text-to-text checkpoints trained on text (frozen, unsynced
vision tower), the MoE load-balancing loss (hand-derived, and equal to transformers' on an
unpacked batch), the server flags picked per family, and the refusal to reload routed experts into a
CPU server that would leave them unpacked."""

import copy

import numpy as np
import pytest
import torch

pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from asyncgrpo.cli.tiny_model import save_tiny_model
from asyncgrpo.generation.model_flags import model_flags
from asyncgrpo.generation.server_info import ServerInfo
from asyncgrpo.generation.vllm_worker_extension import WORKER_EXTENSION
from asyncgrpo.losses.token_logprobs import row_logprobs
from asyncgrpo.modeling.models import (
    freeze_outside_language_model,
    load_balancing_loss,
    load_model,
    router_aux_loss_coef,
)
from asyncgrpo.packing.tree_attention import enable_tree_attention
from asyncgrpo.packing.trie import pack_row
from asyncgrpo.records.sample import Sample
from asyncgrpo.weight_sync import check_moe_reload
from asyncgrpo.weight_sync.base import serving_tensors


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: save_tiny_model(root / arch, arch=arch) for arch in ("qwen3", "qwen3_5_vl", "qwen3_moe")}


def test_load_balancing_loss_by_hand():
    """2 experts, top-1, one layer. Token a: probs (0.75, 0.25) -> expert 0; token b: (0.25, 0.75)
    -> expert 1; b counted twice (a shared prefix of two samples). f = (1/3, 2/3), P = (5/12, 7/12):
    2 * (5/36 + 14/36) = 19/18."""
    logits = torch.log(torch.tensor([[0.75, 0.25], [0.25, 0.75], [0.5, 0.5]]))
    weights = torch.tensor([1.0, 2.0, 0.0])  # the last row is padding
    loss = load_balancing_loss((logits,), top_k=1, token_weights=weights)
    assert loss.item() == pytest.approx(19 / 18, rel=1e-6)


def test_load_balancing_loss_matches_transformers():
    torch.manual_seed(0)
    logits = tuple(torch.randn(7, 4) for _ in range(3))
    ours = load_balancing_loss(logits, top_k=2, token_weights=torch.ones(7))
    assert ours.item() == pytest.approx(float(load_balancing_loss_func(logits, 4, 2)), rel=1e-6)


def test_router_aux_loss_coef(model_dirs):
    moe = load_model(str(model_dirs["qwen3_moe"])).config
    dense = load_model(str(model_dirs["qwen3"])).config
    assert router_aux_loss_coef(moe, None) == moe.router_aux_loss_coef  # the config's default
    assert router_aux_loss_coef(moe, 0.5) == 0.5
    assert router_aux_loss_coef(dense, None) == 0.0
    with pytest.raises(ValueError, match="no routed experts"):
        router_aux_loss_coef(dense, 0.01)


def test_packed_aux_loss_counts_each_sample(model_dirs):
    """A tree-packed row's aux loss equals the one of the same samples forwarded one by one (a
    shared prompt counted once per sample, padding not at all), and reaches the router weights."""
    model = load_model(str(model_dirs["qwen3_moe"]))
    tree = enable_tree_attention(copy.deepcopy(model))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 900, 30)
    samples = []
    for _ in range(4):
        tokens = np.concatenate([prompt, rng.integers(0, 900, 10)])
        trained = np.arange(40) >= 30
        samples.append(Sample(tokens, trained, np.zeros(10, np.float32), 1.0, 0))
    row = pack_row(samples)
    assert row.packing_ratio > 2
    out = row_logprobs(tree, row, router_aux_loss=True)
    with torch.no_grad():
        logits = [
            model(input_ids=torch.from_numpy(s.token_ids)[None], output_router_logits=True).router_logits
            for s in samples
        ]
    per_layer = tuple(
        torch.cat([sample_logits[i] for sample_logits in logits]) for i in range(len(logits[0]))
    )
    want = load_balancing_loss_func(per_layer, model.config.num_experts, model.config.num_experts_per_tok)
    assert out.aux_loss.item() == pytest.approx(float(want), rel=1e-5)
    out.aux_loss.backward()
    assert tree.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_vision_checkpoint_trains_its_language_model(model_dirs):
    model = load_model(str(model_dirs["qwen3_5_vl"]))
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    frozen = freeze_outside_language_model(model)
    assert frozen and all(name.startswith("model.visual.") for name in frozen)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert all(n.startswith(("model.language_model.", "lm_head.")) for n in trainable)
    served = [name for name, _ in serving_tensors(model)]
    assert served and not any(name.startswith("model.visual.") for name in served)
    # The names are the checkpoint's: what the server loaded at start.
    assert set(served) <= _checkpoint_names(model_dirs["qwen3_5_vl"])
    assert freeze_outside_language_model(load_model(str(model_dirs["qwen3"]))) == []


def _checkpoint_names(directory) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_serve_flags(model_dirs, tmp_path):
    assert model_flags(str(model_dirs["qwen3"]), on_cpu=True, dtype=None)[0] == []
    flags, reasons = model_flags(str(model_dirs["qwen3_5_vl"]), on_cpu=True, dtype=None)
    assert flags == ["--language-model-only", "--dtype", "bfloat16", "--no-enable-prefix-caching"]
    assert len(reasons) == 3
    assert model_flags(str(model_dirs["qwen3_5_vl"]), on_cpu=False, dtype=None)[0] == [
        "--language-model-only"
    ]
    with pytest.raises(ValueError, match="bfloat16 only"):
        model_flags(str(model_dirs["qwen3_5_vl"]), on_cpu=True, dtype="float32")
    qwen3_5 = save_tiny_model(tmp_path / "q35", arch="qwen3_5")
    assert model_flags(str(qwen3_5), on_cpu=True, dtype="bfloat16")[0] == ["--no-enable-prefix-caching"]
    # Routed experts on CPU: the worker extension that repacks them at every reload.
    assert model_flags(str(model_dirs["qwen3_moe"]), on_cpu=True, dtype=None)[0] == [
        "--worker-extension-cls",
        WORKER_EXTENSION,
    ]
    assert model_flags(str(model_dirs["qwen3_moe"]), on_cpu=False, dtype=None)[0] == []


def test_a_moe_model_is_not_reloaded_into_a_cpu_server_without_the_worker_extension(model_dirs):
    moe, dense = (load_model(str(model_dirs[arch])) for arch in ("qwen3_moe", "qwen3"))
    with pytest.raises(ValueError, match="--worker-extension-cls"):
        check_moe_reload(ServerInfo(device="cpu"), moe)
    check_moe_reload(ServerInfo(device="cpu", worker_extension=WORKER_EXTENSION), moe)
    check_moe_reload(ServerInfo(device="cuda"), moe)  # GPU kernels read the weights as loaded
    check_moe_reload(ServerInfo(device="cpu"), dense)
    check_moe_reload(None, moe)  # a server that does not say: nothing to check


def test_row_loss_adds_the_weighted_aux_loss(model_dirs, tmp_path):
    """The trainer's row loss: + coef x aux_loss x the row's share of the step's trained tokens, and
    `aux_loss` logged before the coefficient; coefficient 0 adds and logs nothing."""
    from asyncgrpo import AsyncGRPOConfig
    from asyncgrpo.trainer.row_loss import row_loss

    model = enable_tree_attention(load_model(str(model_dirs["qwen3_moe"])))
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 900, 20)
    samples = [
        Sample(
            np.concatenate([prompt, rng.integers(0, 900, 6)]),
            np.arange(26) >= 20,
            np.full(6, -3.0, np.float32),
            a,
            0,
        )
        for a in (1.0, -1.0)
    ]
    row = pack_row(samples)
    total = 2.0 * row.num_entries  # the step's trained tokens: this row is half of them

    def loss_of(coef):
        args = AsyncGRPOConfig(
            output_dir=str(tmp_path), router_aux_loss_coef=coef, report_to="none", score_centering=False
        )
        with torch.no_grad():
            return row_loss(model, row, total, args)

    plain, plain_metrics = loss_of(0.0)
    with_aux, metrics = loss_of(0.5)
    assert "aux_loss" not in plain_metrics
    aux = metrics["aux_loss"].value / metrics["aux_loss"].weight
    assert float(aux) > 0
    assert float(with_aux - plain) == pytest.approx(0.5 * float(aux) * 0.5, rel=1e-5)
