"""Off-policy correction modes by hand on a tree-packed row whose samples share a prompt and a turn;
their composition with both losses (gradients by hand, zero on masked tokens); the correction and
mismatch metrics; the config fields."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.losses.off_policy import MODES, CorrectionSettings, correct, mismatch_kl
from asyncgrpo.losses.policy_loss import LossInputs, clipped_surrogate_loss, score_centered_loss
from asyncgrpo.packing.trie import pack_row
from asyncgrpo.records.sample import Sample
from asyncgrpo.trainer.row_loss import mismatch_by_staleness

BAND = (0.5, 3.0)


def packed_example():
    """A and B share the prompt [1, 2, 3], whose last position predicts the trained token 4 of both
    (one packed position, an entry in each); C is A's conversation continued: A's trained tokens 4, 5
    are C's untrained context (shared in the trie) and C trains token 8 alone. Token ratios: A [2, 2],
    B [0.5, 1.5], C [0.2]; sequence ratios (products) A 4, B 0.75, C 0.2; geometric means A 2,
    B sqrt(0.75), C 0.2."""

    def sample(tokens, trained_from, advantage, version=0):
        tokens = np.array(tokens)
        trained = np.arange(len(tokens)) >= trained_from
        return Sample(tokens, trained, np.zeros(int(trained.sum()), np.float32), advantage, 0,
                      model_version=version)  # fmt: skip

    a = sample([1, 2, 3, 4, 5], 3, advantage=1.0)
    b = sample([1, 2, 3, 4, 6], 3, advantage=-1.0, version=1)
    c = sample([1, 2, 3, 4, 5, 7, 8], 6, advantage=-1.0)
    row = pack_row([a, b, c])
    # The prompt (3 samples), A's completion (A and C), C's 7, 8, B's 4, 6.
    assert row.token_multiplicity.tolist() == [3, 3, 3, 2, 2, 1, 1, 1, 1]
    assert row.entry_sample.tolist() == [0, 0, 1, 1, 2]
    rho = torch.tensor([2.0, 2.0, 0.5, 1.5, 0.2], dtype=torch.float64)
    logprobs = torch.full((5,), -1.0, dtype=torch.float64)
    return row, logprobs, logprobs - rho.log(), torch.tensor(row.advantages, dtype=torch.float64)


def settings(mode, threshold=None, enabled=True):
    return CorrectionSettings(enabled, mode, *BAND, threshold)


# mode -> (keep, weight (None: masking only), masked low, masked high, truncated low, truncated high)
Z = [0] * 5
EXPECTED = {
    "icepop": ([1, 1, 1, 1, 0], None, [0, 0, 0, 0, 1], Z, Z, Z),
    "token_mask": ([1, 1, 1, 1, 0], [2, 2, 0.5, 1.5, 0], [0, 0, 0, 0, 1], Z, Z, Z),
    "token_truncate": ([1] * 5, [2, 2, 0.5, 1.5, 0.5], Z, Z, [0, 0, 0, 0, 1], Z),
    "sequence_mask": ([0, 0, 1, 1, 0], [0, 0, 0.75, 0.75, 0], [0, 0, 0, 0, 1], [1, 1, 0, 0, 0], Z, Z),
    "sequence_truncate": ([1] * 5, [3, 3, 0.75, 0.75, 0.5], Z, Z, [0, 0, 0, 0, 1], [1, 1, 0, 0, 0]),
    "sequence_geometric_mask": ([1, 1, 1, 1, 0], None, [0, 0, 0, 0, 1], Z, Z, Z),
}  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_on_a_packed_row_with_shared_prefixes(mode):
    row, logprobs, sampler, advantages = packed_example()
    c = correct(
        logprobs, sampler, advantages, torch.tensor(row.entry_sample), row.num_samples, settings(mode)
    )
    keep, weight, low, high, t_low, t_high = EXPECTED[mode]
    assert c.keep.tolist() == [bool(k) for k in keep]
    if weight is None:
        assert c.weight is None
    else:
        torch.testing.assert_close(c.weight, torch.tensor(weight, dtype=torch.float64))
    assert c.masked_low.tolist() == [bool(v) for v in low]
    assert c.masked_high.tolist() == [bool(v) for v in high]
    assert c.truncated_low.tolist() == [bool(v) for v in t_low]
    assert c.truncated_high.tolist() == [bool(v) for v in t_high]


def test_geometric_mask_uses_each_sequences_own_length():
    """Band [0.9, 3]: B's geometric mean sqrt(0.75) = 0.866 leaves it, A's 2 does not; the product
    ratio would have kept B (0.75 < 0.9 too, but A's 4 > 3 would have gone)."""
    row, logprobs, sampler, advantages = packed_example()
    tight = CorrectionSettings(True, "sequence_geometric_mask", 0.9, 3.0, None)
    c = correct(logprobs, sampler, advantages, torch.tensor(row.entry_sample), row.num_samples, tight)
    assert c.keep.tolist() == [True, True, False, False, False]


def test_off_policy_sequence_mask_by_hand():
    """Mean log q - log p per sequence: A -log 2 (A > 0 anyway), B -(log 0.5 + log 1.5) / 2 = 0.144,
    C -log 0.2 = 1.609; B and C have negative advantages. Threshold 0.5 masks C, 0.1 also B."""
    row, logprobs, sampler, advantages = packed_example()
    entry_sample = torch.tensor(row.entry_sample)
    c = correct(logprobs, sampler, advantages, entry_sample, 3, settings("token_truncate", 0.5))
    assert c.masked_off_policy.tolist() == [False, False, False, False, True]
    assert c.keep.tolist() == [True, True, True, True, False]
    assert c.weight[4] == 0  # a reweighting mode's masked entry weighs nothing
    c = correct(logprobs, sampler, advantages, entry_sample, 3, settings("token_truncate", 0.1))
    assert c.masked_off_policy.tolist() == [False, False, True, True, True]


def test_correction_off_keeps_everything_unweighted():
    row, logprobs, sampler, advantages = packed_example()
    c = correct(
        logprobs,
        sampler,
        advantages,
        torch.tensor(row.entry_sample),
        3,
        settings("sequence_mask", 0.1, False),
    )
    assert c.keep.all() and c.weight is None and not c.masked_off_policy.any()


def loss_inputs(row, logprobs, sampler, advantages):
    """Leaf log-probs; zero top-N log-probs, so the centering term has no gradient w.r.t. them."""
    leaf = logprobs.clone().requires_grad_()
    top = torch.zeros(len(leaf), 1, dtype=torch.float64)
    return leaf, LossInputs(leaf, sampler, advantages, torch.tensor(row.entry_sample), None, top,
                            torch.full_like(top, -1.0), num_samples=row.num_samples)  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_fn", [score_centered_loss, clipped_surrogate_loss])
def test_modes_compose_with_both_losses(mode, loss_fn):
    """d loss / d log p_t = -A_t * f_t / N with f_t = m_t * w_t; where a mode only masks, w_t is 1 for
    the score-centered loss and the loss's own ratio rho_t for the clipped one (a trust region wide
    enough to clip nothing). A masked token's gradient is exactly zero."""
    row, logprobs, sampler, advantages = packed_example()
    leaf, x = loss_inputs(row, logprobs, sampler, advantages)
    loss, metrics = loss_fn(x, correction=settings(mode), epsilon=1.0, epsilon_high=100.0,
                            num_trained_tokens_global=10, gradient_accumulation_steps=1)  # fmt: skip
    loss.backward()
    keep, weight = EXPECTED[mode][:2]
    rho = torch.tensor([2.0, 2.0, 0.5, 1.5, 0.2], dtype=torch.float64)
    if weight is None:
        weight = torch.ones(5, dtype=torch.float64) if loss_fn is score_centered_loss else rho
    factor = torch.tensor(keep, dtype=torch.float64) * torch.as_tensor(weight, dtype=torch.float64)
    torch.testing.assert_close(leaf.grad, -advantages * factor / 10)
    assert (leaf.grad[torch.tensor(keep) == 0] == 0).all()
    assert metrics["sampling/masked_mean"].result() == pytest.approx(keep.count(0) / 5)


def test_correction_metrics_by_reason():
    """sequence_truncate with off-policy masking at 0.5: truncated high A's 2 tokens (1 of 3
    sequences), truncated low and masked off-policy C's token; any mask: C."""
    row, logprobs, sampler, advantages = packed_example()
    _, x = loss_inputs(row, logprobs, sampler, advantages)
    correction = settings("sequence_truncate", 0.5)
    _, m = score_centered_loss(x, correction=correction, epsilon=0.2, epsilon_high=0.2,
                               num_trained_tokens_global=5, gradient_accumulation_steps=1)  # fmt: skip
    want = {
        "sampling/masked_mean": 1 / 5,
        "sampling/masked_tokens/off_policy": 1 / 5,
        "sampling/masked_tokens/ratio_low": 0.0,
        "sampling/truncated_tokens/high": 2 / 5,
        "sampling/truncated_tokens/low": 1 / 5,
        "sampling/masked_sequences/any": 1 / 3,
        "sampling/masked_sequences/off_policy": 1 / 3,
        "sampling/truncated_sequences/high": 1 / 3,
        "sampling/truncated_sequences/low": 1 / 3,
        "sampling/mismatch_kl/max": 0.2 - 1 - math.log(0.2),
    }
    for name, value in want.items():
        assert float(m[name].result()) == pytest.approx(value), name


def test_mismatch_kl_is_k3_and_zero_on_agreement():
    logprobs = torch.tensor([-1.0, -2.0, -0.5])
    sampler = torch.tensor([-1.0, -2.0 - math.log(2.0), -0.5 + math.log(4.0)])  # rho 1, 2, 0.25
    want = [0.0, 2 - 1 - math.log(2), 0.25 - 1 - math.log(0.25)]
    torch.testing.assert_close(mismatch_kl(logprobs, sampler), torch.tensor(want))


def test_mismatch_kl_split_by_staleness():
    """Samples of versions [3, 2, 3] under a trainer at version 3: fresh entries are samples 0 and 2,
    stale ones sample 1; a split with no entries is not logged."""
    row = SimpleNamespace(sample_versions=np.array([3, 2, 3]), entry_sample=np.array([0, 0, 1, 2]))
    rho = torch.tensor([1.0, 2.0, 0.5, 0.25])
    x = LossInputs(torch.zeros(4), -rho.log(), torch.ones(4), torch.tensor(row.entry_sample))
    k3 = (rho - 1 - rho.log()).tolist()
    m = mismatch_by_staleness(x, row, policy_version=3)
    assert m["sampling/mismatch_kl/fresh_mean"].result() == pytest.approx((k3[0] + k3[1] + k3[3]) / 3)
    assert m["sampling/mismatch_kl/stale_mean"].result() == pytest.approx(k3[2])
    assert set(mismatch_by_staleness(x, row, policy_version=2)) == {"sampling/mismatch_kl/fresh_mean"}


def test_config_fields_and_errors(tmp_path):
    def config(**kw):
        return AsyncGRPOConfig(output_dir=str(tmp_path), **kw)

    args = config()
    assert (args.vllm_importance_sampling_correction, args.vllm_importance_sampling_mode) == (True, "icepop")
    assert args.off_policy_mask_threshold is None
    config(vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_max=None)
    with pytest.raises(ValueError, match="not a mode: pick one of icepop, token_truncate"):
        config(vllm_importance_sampling_mode="sequence")
    with pytest.raises(ValueError, match="off_policy_mask_threshold"):
        config(off_policy_mask_threshold=-1.0)


def test_the_mismatch_warning_fires_on_the_measured_disagreement_not_on_the_dtype(caplog):
    """bf16 serving of an fp32 trainer (the usual GPU set-up) is no reason to warn by itself: the run
    warns once, saying what to check, when the fresh mismatch it measures exceeds what precision
    explains."""
    import logging

    from asyncgrpo.cli.tiny_model import build_model, build_tokenizer
    from asyncgrpo.losses.off_policy import MISMATCH_KL_PRECISION_FLOOR
    from asyncgrpo.trainer.mismatch_watch import FRESH_MISMATCH, MismatchWatch

    model = build_model(build_tokenizer())  # float32
    watch = MismatchWatch("bfloat16", model)
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.trainer.mismatch_watch"):
        assert watch.check({FRESH_MISMATCH: 1.2e-4, "loss": 0.1}, step=1) is None  # bf16's own level
        assert watch.check({"loss": 0.1}, step=2) is None  # a window without fresh samples
        message = watch.check({FRESH_MISMATCH: 10 * MISMATCH_KL_PRECISION_FLOOR}, step=3)
        assert watch.check({FRESH_MISMATCH: 1.0}, step=4) is None  # once per run
    assert [record.getMessage() for record in caplog.records] == [message]
    assert message.startswith(f"step 3: {FRESH_MISMATCH}=0.01 ")
    assert "--dtype float32" in message and "moe_routing_replay" in message
    assert "--dtype" not in MismatchWatch("float32", model).check({FRESH_MISMATCH: 1.0}, step=1)
