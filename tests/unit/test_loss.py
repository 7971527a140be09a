"""Losses: score-centered gradient against a brute-force formula over a small vocabulary, clipped
surrogate hand values in each region, masking bounds, normalization, metrics by hand."""

import math

import numpy as np
import pytest
import torch

from asyncgrpo.losses.off_policy import CorrectionSettings
from asyncgrpo.losses.policy_loss import LossInputs, clipped_surrogate_loss, score_centered_loss
from asyncgrpo.losses.token_logprobs import token_logprobs
from asyncgrpo.records.metrics import MetricsWindow, Stat


def icepop(clip_min: float, clip_max: float) -> CorrectionSettings:
    """Today's token masking in the band, the default mode."""
    return CorrectionSettings(True, "icepop", clip_min, clip_max, None)


SETTINGS = {"correction": icepop(0.5, 5.0), "epsilon": 0.2, "epsilon_high": 0.28}
UNMASKED = dict(SETTINGS, correction=icepop(0.0, math.inf))  # nothing masked


def centering_case(seed, top_n, vocab=7, entries=5, temperature=0.7):
    """Trainer logits z, a different sampler distribution q, targets drawn from q, top-N of q."""
    rng = np.random.default_rng(seed)
    logits = torch.tensor(rng.normal(size=(entries, vocab)) * 1.5, requires_grad=True)  # float64
    q = torch.softmax(torch.tensor(rng.normal(size=(entries, vocab))), -1)
    targets = torch.tensor([rng.choice(vocab, p=q[e].numpy()) for e in range(entries)])
    top_ids = torch.argsort(q, -1, descending=True)[:, :top_n]
    advantages = torch.tensor(rng.normal(size=entries))
    out = token_logprobs(logits, torch.eye(vocab, dtype=torch.float64), targets, temperature, top_ids=top_ids)
    x = LossInputs(
        logprobs=out.logprobs,
        sampler_logprobs=q.log().gather(1, targets[:, None])[:, 0],
        advantages=advantages,
        entry_sample=torch.zeros(entries, dtype=torch.int64),
        entropy=out.entropy,
        top_logprobs=out.top_logprobs,
        sampler_top_logprobs=q.log().gather(1, top_ids),
    )
    return logits, q, targets, top_ids, advantages, x


def expected_centered_gradient(logits, q, targets, top_ids, advantages, temperature, scale):
    """-A * (e_y - qhat) / T * scale, qhat = q on H and alpha * p off H: the formula, by brute force."""
    p = torch.softmax(logits.detach() / temperature, -1)
    grads = torch.zeros_like(p)
    for e in range(len(targets)):
        in_h = torch.zeros(p.shape[1], dtype=torch.bool)
        in_h[top_ids[e]] = True
        alpha = (1 - q[e][in_h].sum()) / (1 - p[e][in_h].sum())
        qhat = torch.where(in_h, q[e], alpha * p[e])
        one_hot = torch.nn.functional.one_hot(targets[e], p.shape[1]).double()
        grads[e] = -advantages[e] * (one_hot - qhat) / temperature * scale
    return grads


@pytest.mark.parametrize("top_n", [1, 3, 6])
def test_score_centered_gradient_matches_formula(top_n):
    logits, q, targets, top_ids, advantages, x = centering_case(seed=top_n, top_n=top_n)
    loss, metrics = score_centered_loss(
        x, **UNMASKED, num_trained_tokens_global=10, gradient_accumulation_steps=2
    )
    loss.backward()
    want = expected_centered_gradient(logits, q, targets, top_ids, advantages, 0.7, scale=1 / 20)
    torch.testing.assert_close(logits.grad, want)
    q_h = q.gather(1, top_ids).sum(-1)
    assert np.isclose(metrics["sampling/sampler_mass"].result(), q_h.mean().item())


def test_full_vocabulary_is_exact_centering():
    """H = the whole vocabulary: qhat = q, gradient = -A * (e_y - q) / T (scaled)."""
    logits, q, targets, _, advantages, x = centering_case(seed=0, top_n=7)
    loss, _ = score_centered_loss(x, **UNMASKED, num_trained_tokens_global=5, gradient_accumulation_steps=1)
    loss.backward()
    one_hot = torch.nn.functional.one_hot(targets, 7).double()
    torch.testing.assert_close(logits.grad, -advantages[:, None] * (one_hot - q) / 0.7 / 5)


def test_score_centering_differs_from_plain_policy_gradient():
    """With a sampler that differs from the trainer the centering term is not zero."""
    logits, _, targets, _, advantages, x = centering_case(seed=9, top_n=3)
    score_centered_loss(x, **UNMASKED, num_trained_tokens_global=5, gradient_accumulation_steps=1)[
        0
    ].backward()
    p = torch.softmax(logits.detach() / 0.7, -1)
    plain = -advantages[:, None] * (torch.nn.functional.one_hot(targets, 7).double() - p) / 0.7 / 5
    assert (logits.grad - plain).abs().max() > 1e-3


def test_masked_tokens_contribute_nothing():
    logits, q, targets, top_ids, advantages, x = centering_case(seed=4, top_n=3)
    # s_t only enters through rho: set it so that entries 0-2 are kept, 3 (0.3 < 0.5) and 4 (7 > 5) masked.
    rho = torch.tensor([1.0, 0.9, 1.2, 0.3, 7.0], dtype=torch.float64)
    x.sampler_logprobs = x.logprobs.detach() - rho.log()
    loss, metrics = score_centered_loss(
        x, **SETTINGS, num_trained_tokens_global=5, gradient_accumulation_steps=1
    )
    loss.backward()
    want = expected_centered_gradient(logits, q, targets, top_ids, advantages, 0.7, scale=1 / 5)
    want[3:] = 0
    torch.testing.assert_close(logits.grad, want)
    assert metrics["sampling/masked_mean"].result() == pytest.approx(2 / 5)


def test_padding_and_out_of_set_targets_give_no_nan():
    """-1 padded top ids (log p = -inf, q = 0) and a target outside its candidate set (log p = -inf,
    rho = 0, masked) must leave loss and gradient finite."""
    logits = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    top_ids = torch.tensor([[0, 1, -1], [2, -1, -1], [-1, -1, -1]])
    out = token_logprobs(
        logits, torch.eye(6, dtype=torch.float64), torch.tensor([0, 2, 5]), 1.0, top_ids=top_ids,
        candidate_offsets=torch.tensor([0, 0, 0, 2]), candidate_ids=torch.tensor([1, 2]),  # entry 2: {1, 2}
    )  # fmt: skip
    assert out.logprobs[2] == float("-inf")
    sampler_top = torch.tensor([[-0.5, -1.5, -math.inf], [-0.1, -math.inf, -math.inf], [-math.inf] * 3])
    x = LossInputs(
        out.logprobs, torch.tensor([-0.5, -0.1, -1.0]), torch.tensor([1.0, -1.0, 1.0]),
        torch.tensor([0, 1, 2]),
        out.entropy, out.top_logprobs, sampler_top,
    )  # fmt: skip
    for loss_fn in (score_centered_loss, clipped_surrogate_loss):
        logits.grad = None
        loss, _ = loss_fn(x, **SETTINGS, num_trained_tokens_global=3, gradient_accumulation_steps=1)
        loss.backward(retain_graph=True)
        assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()
        assert (logits.grad[2] == 0).all()


def test_alpha_guards():
    """Q_H rounding above 1 and P_H = 1 (trainer mass all on H): finite, and alpha = 0 (qhat = q on H)."""
    logits = torch.tensor([[5.0, 4.0, -200.0, -200.0]], dtype=torch.float64, requires_grad=True)
    out = token_logprobs(
        logits, torch.eye(4, dtype=torch.float64), torch.tensor([0]), 1.0, top_ids=torch.tensor([[0, 1]])
    )
    sampler_top = torch.tensor([[math.log(0.7), math.log(0.3 + 1e-7)]], dtype=torch.float64)  # Q_H > 1
    advantages = torch.tensor([1.0], dtype=torch.float64)
    x = LossInputs(out.logprobs, sampler_top[:, 0], advantages, torch.tensor([0]),
                   out.entropy, out.top_logprobs, sampler_top)  # fmt: skip
    loss, _ = score_centered_loss(x, **SETTINGS, num_trained_tokens_global=1, gradient_accumulation_steps=1)
    loss.backward()
    # alpha = 0, so the coefficients are q and the gradient is -(e_y - q - p * (1 - Q_H)).
    q = torch.tensor([0.7, 0.3 + 1e-7, 0, 0], dtype=torch.float64)
    p = torch.softmax(logits.detach()[0], -1)
    one_hot = torch.tensor([1.0, 0, 0, 0], dtype=torch.float64)
    torch.testing.assert_close(logits.grad[0], -(one_hot - q - p * (1 - q.sum())))


def test_score_centering_requires_top_logprobs():
    x = LossInputs(torch.zeros(2), torch.zeros(2), torch.ones(2), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="num_sampler_logprobs"):
        score_centered_loss(x, **SETTINGS, num_trained_tokens_global=2, gradient_accumulation_steps=1)


def surrogate_inputs(rho, advantages, entry_sample=None):
    rho = torch.tensor(rho, dtype=torch.float64)
    logprobs = rho.log().clone().requires_grad_()
    entry_sample = (
        torch.zeros(len(rho), dtype=torch.int64) if entry_sample is None else torch.tensor(entry_sample)
    )
    advantages = torch.tensor(advantages, dtype=torch.float64)
    x = LossInputs(logprobs, torch.zeros(len(rho), dtype=torch.float64), advantages,
                   entry_sample)  # fmt: skip
    return logprobs, x


def test_clipped_surrogate_regions_by_hand():
    """eps = 0.2, eps_high = 0.28, mask [0.5, 5]; per token loss and d loss / d logp = -A * rho if
    the unclipped term is the min, else 0."""
    cases = [  # (rho, A, loss_t, grad_t)
        (1.1, 1.0, -1.1, -1.1),  # inside the trust region
        (1.5, 1.0, -1.28, 0.0),  # above 1 + eps_high with A > 0: clipped
        (0.7, -1.0, 0.8, 0.0),  # below 1 - eps with A < 0: clipped
        (1.5, -1.0, 1.5, 1.5),  # above with A < 0: min keeps the unclipped (worse) term
        (0.7, 1.0, -0.7, -0.7),  # below with A > 0: unclipped
        (6.0, 2.0, 0.0, 0.0),  # rho > clip_max: masked out
        (0.4, -1.0, 0.0, 0.0),  # rho < clip_min: masked out
    ]
    logprobs, x = surrogate_inputs([c[0] for c in cases], [c[1] for c in cases])
    loss, metrics = clipped_surrogate_loss(
        x, **SETTINGS, num_trained_tokens_global=7, gradient_accumulation_steps=1
    )
    loss.backward()
    assert loss.item() == pytest.approx(sum(c[2] for c in cases) / 7)
    torch.testing.assert_close(logprobs.grad, torch.tensor([c[3] / 7 for c in cases], dtype=torch.float64))
    assert metrics["sampling/masked_mean"].result() == pytest.approx(2 / 7)
    # low: rho < 0.8 and A < 0 -> cases 2, 6; high: rho > 1.28 and A > 0 -> cases 1, 5.
    assert metrics["clip_ratio/low_mean"].result() == pytest.approx(2 / 7)
    assert metrics["clip_ratio/high_mean"].result() == pytest.approx(2 / 7)
    assert metrics["clip_ratio/region_mean"].result() == pytest.approx(4 / 7)


def test_mask_bounds_are_inclusive():
    rho_low = math.exp(math.log(0.5))  # rho as the loss computes it
    below = np.nextafter(rho_low, 0.0)
    logprobs, x = surrogate_inputs([0.5, below, 5.0], [1.0, 1.0, -1.0])
    settings = dict(
        SETTINGS,
        correction=icepop(float(torch.exp(x.logprobs.detach()[0])), float(torch.exp(x.logprobs.detach()[2]))),
    )
    loss, metrics = clipped_surrogate_loss(
        x, **settings, num_trained_tokens_global=3, gradient_accumulation_steps=1
    )
    loss.backward()
    assert logprobs.grad[0] != 0 and logprobs.grad[1] == 0 and logprobs.grad[2] != 0
    assert metrics["sampling/masked_mean"].result() == pytest.approx(1 / 3)


def test_normalization_over_processes_and_accumulation():
    """Two processes x two micro-batches, rho = 1 so loss_t = -A_t. The summed loss is the mean over
    micro-batches of each micro-batch's global token mean."""
    advantages = {  # (process, micro-batch) -> A of its trained tokens
        (0, 0): [1.0, 2.0, 3.0], (1, 0): [4.0, 5.0, 6.0, 7.0],
        (0, 1): [1.0, 1.0, 1.0, 1.0, -2.0], (1, 1): [10.0],
    }  # fmt: skip
    global_tokens = {0: 7.0, 1: 6.0}  # per micro-batch, over both processes
    total = 0.0
    for (process, micro), adv in advantages.items():
        _, x = surrogate_inputs([1.0] * len(adv), adv)
        loss, _ = clipped_surrogate_loss(
            x, **SETTINGS, num_trained_tokens_global=global_tokens[micro], gradient_accumulation_steps=2
        )
        assert loss.item() == pytest.approx(-sum(adv) / global_tokens[micro] / 2)
        total += loss.item()
    assert total == pytest.approx(-(28 / 7 + 12 / 6) / 2)


def test_normalization_arguments_validated():
    _, x = surrogate_inputs([1.0], [1.0])
    with pytest.raises(ValueError, match="num_trained_tokens_global"):
        clipped_surrogate_loss(x, **SETTINGS, num_trained_tokens_global=0, gradient_accumulation_steps=1)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        clipped_surrogate_loss(x, **SETTINGS, num_trained_tokens_global=1, gradient_accumulation_steps=0)


def test_metrics_by_hand():
    """rho = [1, 2, 0.25, 0.7], A = [1, 1, -1, -1], samples [0, 0, 1, 1], eps = eps_high = 0.2."""
    _, x = surrogate_inputs([1.0, 2.0, 0.25, 0.7], [1.0, 1.0, -1.0, -1.0], entry_sample=[0, 0, 1, 1])
    x.entropy = torch.tensor([1.0, 2.0, 3.0, 4.0])
    x.top_logprobs = torch.zeros(4, 2, dtype=torch.float64)
    x.sampler_top_logprobs = torch.tensor([[math.log(0.5), math.log(0.3)]] * 4, dtype=torch.float64)
    settings = dict(SETTINGS, epsilon_high=0.2)
    _, m = score_centered_loss(x, **settings, num_trained_tokens_global=4, gradient_accumulation_steps=1)
    want = {
        "sampling/sampling_logp_difference/mean": (0 + math.log(2) + math.log(4) + -math.log(0.7)) / 4,
        "sampling/sampling_logp_difference/max": math.log(4),
        "sampling/importance_sampling_ratio/min": 0.25,
        "sampling/importance_sampling_ratio/mean": (1 + 2 + 0.25 + 0.7) / 4,
        "sampling/importance_sampling_ratio/max": 2.0,
        "sampling/masked_mean": 1 / 4,  # rho = 0.25 < 0.5
        # k3 = rho - 1 - log rho per token
        "sampling/mismatch_kl/mean": sum(r - 1 - math.log(r) for r in (1.0, 2.0, 0.25, 0.7)) / 4,
        "sampling/mismatch_kl/max": 0.25 - 1 - math.log(0.25),
        "sampling/masked_tokens/ratio_low": 1 / 4,
        "sampling/masked_tokens/ratio_high": 0.0,
        "sampling/masked_tokens/off_policy": 0.0,
        "sampling/truncated_tokens/low": 0.0,
        "sampling/truncated_tokens/high": 0.0,
        "sampling/masked_sequences/any": 1 / 2,  # sample 1
        "sampling/masked_sequences/ratio_low": 1 / 2,
        "sampling/masked_sequences/ratio_high": 0.0,
        "sampling/masked_sequences/off_policy": 0.0,
        "sampling/truncated_sequences/low": 0.0,
        "sampling/truncated_sequences/high": 0.0,
        "sampling/sampler_mass": 0.8,
        "entropy": 2.5,
        "clip_ratio/low_mean": 2 / 4,  # entries 2, 3
        "clip_ratio/low_min": 0.0,  # sample 0: 0/2, sample 1: 2/2
        "clip_ratio/high_mean": 1 / 4,  # entry 1
        "clip_ratio/high_max": 0.5,  # sample 0: 1/2
        "clip_ratio/region_mean": 3 / 4,
    }
    assert set(m) == set(want)
    for name, value in want.items():
        assert float(m[name].result()) == pytest.approx(value), name
    _, m_surrogate = clipped_surrogate_loss(
        x, **settings, num_trained_tokens_global=4, gradient_accumulation_steps=1
    )
    assert set(m) - set(m_surrogate) == {"sampling/sampler_mass"}


def test_per_sample_clip_fractions_with_the_sample_count_known():
    """The trainer passes the row's sample count (no device read); a sample with no entries (here 1
    of samples 0..3) must not count as a sample clipped 0/0. Same rho, A and eps as above, entries of
    samples [0, 0, 2, 2]: low fractions 0/2 and 2/2, high 1/2 and 0/2."""
    _, x = surrogate_inputs([1.0, 2.0, 0.25, 0.7], [1.0, 1.0, -1.0, -1.0], entry_sample=[0, 0, 2, 2])
    settings = dict(SETTINGS, epsilon_high=0.2)
    for num_samples in (None, 3, 4):
        x.num_samples = num_samples
        _, m = clipped_surrogate_loss(
            x, **settings, num_trained_tokens_global=4, gradient_accumulation_steps=1
        )
        assert float(m["clip_ratio/low_min"].result()) == 0.0, num_samples
        assert float(m["clip_ratio/high_max"].result()) == 0.5, num_samples
    x.entry_sample = torch.tensor([2, 2, 2, 2])  # the only sample is all clipped low or high
    x.num_samples = 4
    _, m = clipped_surrogate_loss(x, **settings, num_trained_tokens_global=4, gradient_accumulation_steps=1)
    assert float(m["clip_ratio/low_min"].result()) == 0.5  # entries 2, 3 of 4
    assert float(m["clip_ratio/high_max"].result()) == 0.25  # entry 1 of 4


def test_metrics_merge_exactly_across_micro_batches():
    rng = np.random.default_rng(0)
    rho, adv = rng.uniform(0.3, 2.0, 12), rng.normal(size=12)
    samples = np.repeat(np.arange(4), 3)
    _, whole = surrogate_inputs(rho, adv, samples)
    _, m_whole = clipped_surrogate_loss(
        whole, **SETTINGS, num_trained_tokens_global=12, gradient_accumulation_steps=1
    )
    window = MetricsWindow()
    for part in (slice(0, 5), slice(5, 12)):  # an uneven split, cutting sample 1 in two
        _, x = surrogate_inputs(rho[part], adv[part], samples[part])
        _, m = clipped_surrogate_loss(
            x, **SETTINGS, num_trained_tokens_global=12, gradient_accumulation_steps=1
        )
        window.merge({k: Stat(s.reduce, float(s.value), s.weight) for k, s in m.items()})
    for name, stat in m_whole.items():
        if name in ("clip_ratio/low_min", "clip_ratio/high_max") or "_sequences/" in name:
            continue  # per-sample: a sample cut across micro-batches is two samples (never in training)
        assert window.stats()[name].result() == pytest.approx(float(stat.result())), name
