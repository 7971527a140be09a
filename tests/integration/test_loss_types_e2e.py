"""Every loss_type trains a few steps end to end against the real vLLM server (the suite's shared one), each
run also exercising a part of the menu around it (sequence ratios, KL with TR-DPO reference updates,
the entropy mask and the adaptive bonus, reward weights and GDPO, batch scaling, truncation masking,
DAPO's overlong reward), and logs TRL's metric names for it (docs/metrics.md, "The loss menu")."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("msgspec", reason="the trainer needs msgspec (a GPU host may lack it)")
pytest.importorskip("datasets", reason="the test workers need datasets (a GPU host may lack it)")

import torch  # noqa: E402
from conftest import make_config  # noqa: E402
from worker_side import even_token_reward, prompts, token_parity_reward  # noqa: E402

from asyncgrpo import AsyncGRPOTrainer  # noqa: E402
from asyncgrpo.rewards import get_soft_overlong_punishment  # noqa: E402
from asyncgrpo.trainer.algorithm_state import ALGORITHM_STATE_FILE, REFERENCE_MODEL_FILE  # noqa: E402

pytestmark = pytest.mark.vllm

CLIP_METRICS = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
# loss_type: (the run's other settings, metrics it must log, reward functions)
RUNS = {
    "grpo": ({"importance_sampling_level": "sequence"}, CLIP_METRICS, [token_parity_reward]),
    "dr_grpo": ({"scale_rewards": "none"}, CLIP_METRICS, [token_parity_reward]),
    "dapo": (
        {
            "beta": 0.05,
            "sync_ref_model": True,
            "ref_model_sync_steps": 1,
            "epsilon_high": 0.28,
            "save_strategy": "steps",
            "save_steps": 2,
        },
        [*CLIP_METRICS, "kl"],
        [token_parity_reward, get_soft_overlong_punishment(16, 4)],
    ),
    "bnpo": ({"top_entropy_quantile": 0.5, "delta": 1.5}, CLIP_METRICS, [token_parity_reward]),
    "cispo": ({"epsilon_high": 5.0}, ["cispo_clip_ratio"], [token_parity_reward]),
    "sapo": (
        {
            "use_adaptive_entropy": True,
            "entropy_coef": 0.01,
            "entropy_target": 100.0,
            "save_strategy": "steps",
            "save_steps": 2,
        },
        ["entropy_coef", "policy_loss", "entropy/bonus_tokens_mean"],
        [token_parity_reward],
    ),
    "luspo": (
        {
            "importance_sampling_level": "sequence",
            "reward_weights": [1.0, 0.5],
            "multi_objective_aggregation": "normalize_then_sum",
        },
        CLIP_METRICS,
        [token_parity_reward, even_token_reward],
    ),
    "vespo": (
        {"vllm_importance_sampling_mode": "token_truncate", "scale_rewards": "batch"},
        ["vespo/phi_seq_mean"],
        [token_parity_reward],
    ),
}


@pytest.mark.parametrize("loss_type", list(RUNS))
def test_each_loss_type_trains_against_the_server(loss_type, vllm_server, tiny_model_dir, tmp_path):
    options, metrics, rewards = RUNS[loss_type]
    args = make_config(vllm_server, tmp_path, loss_type=loss_type, max_steps=2, learning_rate=3e-2, **options)
    trainer = AsyncGRPOTrainer(str(tiny_model_dir), rewards, args, train_dataset=prompts())
    initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 2
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2 and all(math.isfinite(entry["loss"]) for entry in logged)
    names = set().union(*(entry.keys() for entry in logged))
    assert not [name for name in metrics if name not in names], f"missing: {sorted(set(metrics) - names)}"
    assert all(math.isfinite(entry[name]) for entry in logged for name in metrics if name in entry)
    assert any(not torch.equal(p.detach(), initial[n]) for n, p in trainer.model.named_parameters())
    if loss_type == "dapo":  # TR-DPO: the reference moved toward the policy, and the checkpoint keeps it
        reference = dict(trainer._loss_menu.reference.model.named_parameters())
        moved = [n for n, p in reference.items() if not torch.equal(p.detach().cpu(), initial[n].cpu())]
        assert moved, "sync_ref_model with ref_model_sync_steps=1 must move the reference"
        assert (tmp_path / "checkpoint-2" / REFERENCE_MODEL_FILE).is_file()
    if loss_type == "sapo":  # the adaptive coefficient rose (entropy under the target) and is checkpointed
        coefficients = [entry["entropy_coef"] for entry in logged]
        assert coefficients == pytest.approx([0.015, 0.02])
        assert (tmp_path / "checkpoint-2" / ALGORITHM_STATE_FILE).is_file()
