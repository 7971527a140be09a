"""The loss menu's pure pieces by hand (docs/algorithm.md, "The loss types"): each policy term on a few
tokens with its gradient, sequence ratios, the correction factor, each loss type's normalization,
asyncgrpo's own losses unchanged under `algorithm_loss`, the KL to a reference (by hand, and against a
reference model that differs from the policy by a known logit scale, a LoRA adapter switched off,
TR-DPO's update), the entropy mask, bonus and adaptive coefficient, the checkpointed state, and the
config's refusals.
TRL's own code checks the same formulas in tests/unit/test_trl_loss_parity.py."""

from __future__ import annotations

import copy
import logging
import math
import re

import numpy as np
import pytest
import torch

from asyncgrpo import AsyncGRPOConfig
from asyncgrpo.cli.tiny_model import build_model, build_tokenizer
from asyncgrpo.losses import AlgorithmSettings, EntropyCoefficient, LossTotals, algorithm_loss
from asyncgrpo.losses.aggregation import aggregate
from asyncgrpo.losses.off_policy import CorrectionSettings, correct
from asyncgrpo.losses.policy_loss import LossInputs, clipped_surrogate_loss, score_centered_loss
from asyncgrpo.losses.policy_terms import cispo_term, clipped_term, sapo_term, vespo_weights
from asyncgrpo.losses.ratios import correction_factor, log_importance_weights
from asyncgrpo.losses.regularizers import entropy_bonus, entropy_threshold, high_entropy_mask, reference_kl
from asyncgrpo.packing.tree_attention import enable_tree_attention
from asyncgrpo.packing.trie import pack_row
from asyncgrpo.records.sample import Sample
from asyncgrpo.trainer.algorithm_state import AlgorithmState
from asyncgrpo.trainer.reference_model import ReferenceModel
from asyncgrpo.trainer.row_loss import StepLoss, algorithm_settings, row_loss

NO_CORRECTION = CorrectionSettings(False, "icepop", None, None, None)


def icepop(low: float, high: float) -> CorrectionSettings:
    return CorrectionSettings(True, "icepop", low, high, None)


def totals(**overrides) -> LossTotals:
    values = dict(
        step_trained_tokens=10.0,
        step_samples=4.0,
        step_rows=3,
        microbatch_trained_tokens=5.0,
        gradient_accumulation_steps=2,
        max_completion_length=8,
    )
    values.update(overrides)
    return LossTotals(**values)


# -- policy terms ---------------------------------------------------------------------------------------


def test_clipped_term_in_each_region_and_with_delta():
    coef = torch.tensor([1.5, 0.5, 1.1, 2.0], requires_grad=True)
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss = clipped_term(coef, advantages, 0.2, 0.28)
    # clipped high (A > 0), clipped low (A < 0), inside, outside on the unclipped side (A < 0, r > 1)
    assert loss.tolist() == pytest.approx([-1.28, 0.8, -1.1, 2.0])
    loss.sum().backward()
    assert coef.grad.tolist() == pytest.approx([0.0, 0.0, -1.0, 1.0])
    coef.grad = None
    capped = clipped_term(coef, advantages, 0.2, 0.28, delta=1.5)  # INTELLECT-2: r capped at delta
    assert capped.tolist() == pytest.approx([-1.28, 0.8, -1.1, 1.5])
    capped.sum().backward()
    assert coef.grad.tolist() == pytest.approx([0.0, 0.0, -1.0, 0.0])


def test_cispo_clips_the_detached_weight_not_the_update():
    logprobs = torch.tensor([-1.0, -2.0], requires_grad=True)
    coef = torch.tensor([0.5, 3.0], requires_grad=True)
    loss = cispo_term(coef, torch.tensor([1.0, 2.0]), logprobs, epsilon_high=2.0)
    assert loss.tolist() == pytest.approx([0.5, 8.0])  # -min(r, 2) A log p
    loss.sum().backward()
    assert logprobs.grad.tolist() == pytest.approx([-0.5, -4.0])  # the clipped token keeps a gradient
    assert coef.grad is None


def test_sapo_gate_at_ratio_one_weighs_the_gradient_one():
    sampler = torch.tensor([-1.0, -0.5])
    logprobs = sampler.clone().requires_grad_(True)  # r = 1
    advantages = torch.tensor([1.0, -1.0])
    loss = sapo_term(torch.exp(logprobs - sampler), advantages, 1.0, 1.05)
    assert loss.tolist() == pytest.approx([-2.0, 2.0 / 1.05])  # -sigmoid(0) 4 / tau A
    loss.sum().backward()
    assert logprobs.grad.tolist() == pytest.approx([-1.0, 1.0])  # -4 sigma'(0) r A = -A


def test_vespo_gamma_weight_by_hand():
    log_ratio = torch.tensor([math.log(2.0), 0.0])  # one sequence: w = 2
    entry = torch.tensor([0, 0])
    positive = vespo_weights(log_ratio, torch.tensor([1.0, 1.0]), entry, 1, None, 2.0, 3.0, 3.0, 2.0)
    assert positive.tolist() == pytest.approx([4 * math.exp(-3)] * 2)  # e^3 2^2 e^-6
    negative = vespo_weights(log_ratio, torch.tensor([-1.0, -1.0]), entry, 1, None, 2.0, 3.0, 3.0, 2.0)
    assert negative.tolist() == pytest.approx([8 * math.exp(-2)] * 2)  # e^2 2^3 e^-4
    # The correction's token weights fold into w: 2 x 0.5 x 0.5 = 0.5.
    folded = vespo_weights(log_ratio, torch.ones(2), entry, 1, torch.tensor([0.5, 0.5]), 2.0, 3.0, 3.0, 2.0)
    assert folded.tolist() == pytest.approx([0.25 * math.exp(1.5)] * 2)
    masked = vespo_weights(log_ratio, torch.ones(2), entry, 1, torch.tensor([0.0, 1.0]), 2.0, 3.0, 3.0, 2.0)
    assert float(masked.max()) < 1e-12  # a masked token (weight 0) all but drops its sequence


def test_sequence_ratio_is_the_geometric_mean_of_its_own_tokens():
    log_ratio = torch.tensor([0.2, 0.4, -0.3], requires_grad=True)
    entry = torch.tensor([0, 0, 1])
    weights = log_importance_weights(log_ratio, entry, 2, "sequence")
    assert weights.tolist() == pytest.approx([0.3, 0.3, -0.3])
    weights[0].backward()
    assert log_ratio.grad.tolist() == pytest.approx([0.5, 0.5, 0.0])
    assert log_importance_weights(log_ratio, entry, 2, "token") is log_ratio


def test_correction_factor_masks_or_replaces_the_loss_ratio():
    logprobs = torch.log(torch.tensor([4.0, 0.25, 1.2]))
    sampler = torch.zeros(3)
    entry, advantages = torch.tensor([0, 0, 1]), torch.ones(3)
    masking = correct(logprobs, sampler, advantages, entry, 2, icepop(0.5, 2.0))
    rho = torch.exp(logprobs)
    assert correction_factor(masking, rho).tolist() == [0.0, 0.0, 1.0]
    truncating = correct(
        logprobs, sampler, advantages, entry, 2, CorrectionSettings(True, "token_truncate", 0.5, 2.0, None)
    )
    # w = clip(r) = 2, 0.5, 1.2 replaces r: w / r
    assert correction_factor(truncating, rho).tolist() == pytest.approx([0.5, 2.0, 1.0])
    # A sequence-level loss ratio g is what the weight replaces: w / g.
    g = torch.tensor([1.0, 1.0, 1.2])
    assert correction_factor(truncating, g).tolist() == pytest.approx([2.0, 0.5, 1.0])


# -- normalization --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("grpo", (1.5 + 4.0) / 4),  # sequence means 1.5 and 4, over the step's 4 sequences
        ("sapo", (1.5 + 4.0) / 4),
        ("luspo", (3.0 + 12.0) / 4),  # sequence sums
        ("dr_grpo", 15.0 / (4 * 8)),  # / (sequences x max_completion_length)
        ("dapo", 15.0 / 10),  # / the step's trained tokens
        ("cispo", 15.0 / 10),
        ("vespo", 15.0 / 10),
        ("bnpo", 15.0 / 5 / 3),  # the row's token mean / the step's rows
        (None, 15.0 / (5 * 2)),  # asyncgrpo's own: / (micro-batch tokens x accumulation)
    ],
)
def test_each_loss_type_normalizes_by_hand(loss_type, expected):
    per_token = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    entry = torch.tensor([0, 0, 1, 1, 1])
    assert float(aggregate(per_token, entry, 2, loss_type, totals())) == pytest.approx(expected)


def test_totals_refuse_empty_counts():
    with pytest.raises(ValueError, match="must be positive"):
        totals(step_samples=0.0)
    with pytest.raises(ValueError, match="microbatch_trained_tokens must be > 0"):
        totals(microbatch_trained_tokens=0.0)


# -- the composition ------------------------------------------------------------------------------------


def own_inputs(seed: int = 0, entries: int = 6) -> tuple[torch.Tensor, LossInputs]:
    rng = np.random.default_rng(seed)
    logits = torch.tensor(rng.normal(size=(entries, 5)), requires_grad=True)
    logp = torch.log_softmax(logits, -1)
    top_ids = torch.tensor([[0, 1]] * entries)
    sampler_top = torch.log_softmax(torch.tensor(rng.normal(size=(entries, 5))), -1).gather(1, top_ids)
    x = LossInputs(
        logprobs=logp[:, 2],
        sampler_logprobs=(logp[:, 2] + torch.tensor(rng.normal(size=entries)) * 0.3).detach(),
        advantages=torch.tensor(rng.normal(size=entries)),
        entry_sample=torch.tensor([0, 0, 0, 1, 1, 2][:entries]),
        entropy=-(logp.exp() * logp).sum(-1),
        top_logprobs=logp.gather(1, top_ids),
        sampler_top_logprobs=sampler_top,
    )
    return logits, x


@pytest.mark.parametrize("score_centering", [True, False])
def test_no_loss_type_runs_asyncgrpos_own_losses_unchanged(score_centering):
    """loss_type=None is asyncgrpo's own loss, value and gradient, bit for bit (the default stays)."""
    correction = icepop(0.5, 5.0)
    own_loss = score_centered_loss if score_centering else clipped_surrogate_loss
    logits, x = own_inputs()
    expected, expected_metrics = own_loss(
        x,
        correction=correction,
        epsilon=0.2,
        epsilon_high=0.2,
        num_trained_tokens_global=9.0,
        gradient_accumulation_steps=2,
    )
    expected.backward()
    expected_grad = logits.grad.clone()
    logits, x = own_inputs()
    settings = AlgorithmSettings(None, score_centering, correction, epsilon=0.2, epsilon_high=0.2)
    loss, metrics = algorithm_loss(x, settings, totals(microbatch_trained_tokens=9.0))
    loss.backward()
    assert loss.item() == expected.item()
    assert torch.equal(logits.grad, expected_grad)
    assert {name: stat.result() for name, stat in metrics.items()} == {
        name: stat.result() for name, stat in expected_metrics.items()
    }


def test_the_kl_term_by_hand_with_bias_correction_and_masks():
    # Policy p = 0.5 on every token, reference 0.25: d = -ln 2, k3 = e^d - d - 1 = ln 2 - 0.5.
    kl = reference_kl(torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25])))
    assert float(kl) == pytest.approx(math.log(2) - 0.5)
    sampler = torch.log(torch.tensor([0.5, 0.5, 0.05]))  # the last token's ratio, 10, leaves the band
    logprobs = torch.log(torch.tensor([0.5, 0.5, 0.5])).requires_grad_(True)
    x = LossInputs(
        logprobs=logprobs,
        sampler_logprobs=sampler,
        advantages=torch.zeros(3),  # no policy gradient: the loss is the KL term alone
        entry_sample=torch.tensor([0, 0, 1]),
        ref_logprobs=torch.log(torch.tensor([0.25, 0.25, 0.25])),
    )
    settings = AlgorithmSettings("dapo", False, icepop(0.5, 5.0), epsilon=0.2, epsilon_high=0.2, beta=0.1)
    loss, metrics = algorithm_loss(x, settings, totals(step_trained_tokens=3.0))
    # The masked token leaves the KL too but stays in the count: 0.1 x 2 (ln 2 - 0.5) / 3.
    assert float(loss) == pytest.approx(0.1 * 2 * (math.log(2) - 0.5) / 3)
    assert metrics["kl"].result() == pytest.approx(2 * (math.log(2) - 0.5) / 3)
    loss.backward()
    # d/dlog p of [k3 x r] at r = 1: (1 - e^d) + k3 = 0.5 + ln 2 - 0.5; times beta / 3
    assert logprobs.grad.tolist() == pytest.approx([0.1 * math.log(2) / 3] * 2 + [0.0])


def test_entropy_mask_threshold_and_bonus_by_hand():
    entropies = torch.tensor([0.1, 0.5, 0.9, 1.3])
    threshold = entropy_threshold(entropies, 0.5)  # the median, interpolated: 0.7
    assert float(threshold) == pytest.approx(0.7)
    assert high_entropy_mask(entropies, threshold).tolist() == [False, False, True, True]
    assert float(entropy_threshold(torch.empty(0), 0.5)) == math.inf
    bonus = entropy_bonus(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([True, False, True]), 0.1, step_rows=2)
    assert float(bonus) == pytest.approx(0.1 * 2.0 / 2)  # coef x (mean over the kept tokens) / rows


def test_adaptive_entropy_coefficient_steps_gates_and_round_trips():
    coefficient = EntropyCoefficient(0.01, adaptive=True, target=0.5, delta=0.005, minimum=0.0, maximum=0.012)
    assert coefficient.enabled and coefficient.applied() == 0.0  # no entropy seen yet: no bonus
    coefficient.update(0.4)  # below the target: more bonus, capped at the maximum
    assert coefficient.coefficient == pytest.approx(0.012) and coefficient.applied() == pytest.approx(0.012)
    coefficient.update(0.9)  # above: less, and the bonus is off while entropy stays above the target
    assert coefficient.coefficient == pytest.approx(0.007) and coefficient.applied() == 0.0
    restored = EntropyCoefficient(0.0, adaptive=True)
    restored.load_state(coefficient.state())
    assert restored.coefficient == coefficient.coefficient and restored.last_entropy == 0.9
    static = EntropyCoefficient(0.02)
    static.update(0.1)
    assert static.applied() == 0.02 and not EntropyCoefficient(0.0).enabled


# -- the reference model --------------------------------------------------------------------------------


def tiny_model():
    torch.manual_seed(0)
    return enable_tree_attention(build_model(build_tokenizer()))


def planted_row(vocab: int, sampler_of=None):
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, vocab, 6)
    samples = [
        Sample(
            np.concatenate([prompt, rng.integers(3, vocab, 4)]),
            np.arange(10) >= 6,
            np.full(4, -2.0, np.float32),
            advantage,
            0,
        )  # fmt: skip
        for advantage in (1.0, -1.0)
    ]
    return samples, pack_row(samples)


def hf_logprobs(model, samples, temperature: float, scale: float = 1.0) -> torch.Tensor:
    """Log p of each trained token by a plain forward of each sample, logits x scale / temperature."""
    values = []
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor(sample.token_ids)[None]
            logits = model(input_ids=ids).logits[0].double() * scale / temperature
            logp = torch.log_softmax(logits, -1)
            positions = np.flatnonzero(sample.trained)
            values.append(logp[positions - 1, ids[0, positions]])
    return torch.cat(values)


def test_kl_against_a_reference_that_differs_by_a_known_logit_scale(tmp_path):
    """The reference is a copy of the initial model; scaling its output head by s makes its log-probs
    log_softmax(s z / T) of the policy's logits z, so the logged KL is known from the policy alone."""
    model = tiny_model()
    args = AsyncGRPOConfig(output_dir=str(tmp_path), beta=0.1, loss_type="dapo", temperature=0.8)
    reference = ReferenceModel.for_policy(model, args)
    samples, row = planted_row(model.config.vocab_size)
    policy = hf_logprobs(model, samples, 0.8)
    for sample, start in zip(samples, (0, 4)):
        sample.sampler_logprobs = policy[start : start + 4].float().numpy()  # on-policy: r = 1
    row = pack_row(samples)
    step = StepLoss(algorithm_settings(args), trained_tokens=8.0, samples=2.0, rows=1, reference=reference)
    _, metrics = row_loss(model, row, 8.0, args, step)
    assert metrics["kl"].result() == pytest.approx(0.0, abs=1e-6)  # the copy is the policy itself
    with torch.no_grad():
        reference.model.lm_head.weight.mul_(1.5)
    _, metrics = row_loss(model, row, 8.0, args, step)
    expected = reference_kl(policy, hf_logprobs(model, samples, 0.8, scale=1.5)).mean()
    assert metrics["kl"].result() == pytest.approx(float(expected), rel=1e-4)
    assert float(expected) > 1e-3


def test_trdpo_sync_moves_the_reference_toward_the_policy(tmp_path):
    model = tiny_model()
    args = AsyncGRPOConfig(output_dir=str(tmp_path), beta=0.1, sync_ref_model=True, ref_model_mixup_alpha=0.6)
    reference = ReferenceModel.for_policy(model, args)
    before = copy.deepcopy(reference.model.state_dict())
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    reference.sync(model, 0.6)
    for name, value in reference.model.state_dict().items():
        torch.testing.assert_close(value, 0.6 * model.state_dict()[name] + 0.4 * before[name])
    assert not any(p.requires_grad for p in reference.model.parameters())


def test_with_lora_the_reference_is_the_base_model_with_the_adapter_off(tmp_path):
    peft = pytest.importorskip("peft")
    base = tiny_model()
    untouched = copy.deepcopy(base)
    policy = peft.get_peft_model(
        base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    args = AsyncGRPOConfig(output_dir=str(tmp_path), beta=0.1)
    reference = ReferenceModel.for_policy(policy, args)
    assert not reference.is_copy  # no second model
    samples, row = planted_row(base.config.vocab_size)
    ref = reference.row_logprobs(policy, row, temperature=1.0)
    torch.testing.assert_close(ref.double(), hf_logprobs(untouched, samples, 1.0), atol=1e-5, rtol=0)
    assert not torch.allclose(ref.double(), hf_logprobs(policy, samples, 1.0), atol=1e-3)
    args = AsyncGRPOConfig(output_dir=str(tmp_path), beta=0.1, sync_ref_model=True)
    with pytest.raises(ValueError, match="sync_ref_model=True with a PEFT adapter"):
        ReferenceModel.for_policy(policy, args)
    assert ReferenceModel.for_policy(policy, AsyncGRPOConfig(output_dir=str(tmp_path))) is None  # beta 0


def test_the_checkpointed_state_round_trips(tmp_path):
    model = tiny_model()
    state = AlgorithmState({"coefficient": 0.03, "last_entropy": math.inf}, model.state_dict())
    state.save(tmp_path)
    loaded = AlgorithmState.load(tmp_path)
    assert loaded.entropy_coefficient == {"coefficient": 0.03, "last_entropy": math.inf}
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.reference[name], value)
    assert AlgorithmState.load(tmp_path / "nothing") == AlgorithmState()


def test_step_counts_come_from_the_plan():
    from asyncgrpo.packing.planner import TokenBudgetBatcher

    rng = np.random.default_rng(0)
    samples = [
        Sample(rng.integers(3, 50, 12), np.arange(12) >= 8 - k, np.zeros(4 + k, np.float32), 1.0, k)
        for k in range(3)
    ]
    batcher = TokenBudgetBatcher(token_budget=1000, num_rows=2, min_shared_tokens=0)
    for sample in samples:
        batcher.offer(sample)
    step = StepLoss.of_plans([batcher.close()], 2, algorithm_settings(AsyncGRPOConfig(output_dir="/tmp/x")))
    assert (step.trained_tokens, step.samples, step.rows) == (4 + 5 + 6, 3.0, 2)


# -- the config's refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"loss_type": "ppo"}, "loss_type='ppo' is not a loss: pick one of grpo, dr_grpo, dapo"),
        ({"loss_type": "dapo", "score_centering": True}, "each pick a loss"),
        ({"importance_sampling_level": "group"}, "must be 'token' or 'sequence'"),
        ({"importance_sampling_level": "sequence"}, "needs a loss_type"),
        (
            {"loss_type": "vespo", "vllm_importance_sampling_mode": "sequence_mask"},
            "must be one of icepop, token_mask, token_truncate",
        ),
        ({"delta": 0.0}, "delta=0.0 must be > 0"),
        ({"sapo_temperature_neg": 0.0}, "sapo_temperature_neg and sapo_temperature_pos must be > 0"),
        ({"vespo_k_pos": -1.0}, "must be >= 0"),
        ({"top_entropy_quantile": 1.5}, "top_entropy_quantile=1.5 must be in [0, 1]"),
        ({"use_adaptive_entropy": True, "entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, "must be <="),
        ({"beta": -0.1}, "beta=-0.1 must be >= 0"),
        ({"sync_ref_model": True}, "sync_ref_model=True with beta=0"),
        ({"beta": 0.1, "ref_model_mixup_alpha": 2.0}, "ref_model_mixup_alpha=2.0 must be in [0, 1]"),
        ({"beta": 0.1, "ref_model_sync_steps": 0}, "ref_model_sync_steps=0 must be >= 1"),
        ({"scale_rewards": "std"}, "scale_rewards='std' must be one of group, batch, none"),
        ({"multi_objective_aggregation": "max"}, "must be one of sum_then_normalize, normalize_then_sum"),
        ({"reward_weights": ["a"]}, "must be a list of finite numbers"),
    ],
)
def test_the_config_refuses_what_cannot_run(fields, message, tmp_path):
    with pytest.raises(ValueError, match=re.escape(message)):
        AsyncGRPOConfig(output_dir=str(tmp_path), **fields)


def test_defaults_keep_score_centering_and_trls_names_resolve(tmp_path, caplog):
    config = AsyncGRPOConfig(output_dir=str(tmp_path))
    assert (config.loss_type, config.score_centering, config.scale_rewards) == (None, True, "group")
    assert AsyncGRPOConfig(output_dir=str(tmp_path), loss_type="dapo").score_centering is False
    assert AsyncGRPOConfig(output_dir=str(tmp_path), scale_rewards=False).scale_rewards == "none"
    assert AsyncGRPOConfig(output_dir=str(tmp_path), scale_rewards=True).scale_rewards == "group"
    with caplog.at_level(logging.WARNING, logger="asyncgrpo"):  # TRL warns here, and so do we
        AsyncGRPOConfig(output_dir=str(tmp_path), loss_type="luspo")
        AsyncGRPOConfig(output_dir=str(tmp_path), loss_type="cispo", importance_sampling_level="sequence")
    assert "LUSPO's paper uses sequence ratios" in caplog.text
    assert "weighs each sequence by its length" in caplog.text


def test_a_resumed_run_continues_the_coefficient_and_the_synced_reference(tmp_path):
    """What a checkpoint kept (trainer/algorithm_state.py) is what the loss menu resumes with."""
    from asyncgrpo.trainer.distributed import Processes
    from asyncgrpo.trainer.loss_menu import LossMenu

    args = AsyncGRPOConfig(
        output_dir=str(tmp_path), beta=0.1, sync_ref_model=True, use_adaptive_entropy=True, entropy_coef=0.01
    )
    saved = LossMenu(tiny_model(), args)
    saved.prepare(Processes(1, 0), False, True, None, AlgorithmState())
    with torch.no_grad():
        saved.reference.model.lm_head.weight.add_(0.5)  # as TR-DPO's updates would have moved it
    saved.entropy.update(0.1)
    saved.state().save(tmp_path)
    resumed = LossMenu(tiny_model(), args)  # built from the initial model, as a resumed trainer is
    resumed.prepare(Processes(1, 0), False, True, None, AlgorithmState.load(tmp_path))
    assert resumed.entropy.state() == saved.entropy.state()
    for (name, value), (_, expected) in zip(
        resumed.reference.model.state_dict().items(), saved.reference.model.state_dict().items()
    ):
        assert torch.equal(value, expected), name
