"""MoE routing replay on the trainer side: the scores and experts by hand, and on a tiny Hugging Face
Qwen3-MoE forwarding a tree-packed row, the trainer's routing equals the recorded one on every
replayed token and the log-prob mismatch against the recording model falls."""

from __future__ import annotations

import math
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from asyncgrpo.cli.tiny_model import save_tiny_model
from asyncgrpo.logprobs import row_logprobs
from asyncgrpo.models import load_model
from asyncgrpo.packing.tree_attention import enable_tree_attention
from asyncgrpo.packing.trie import pack_row
from asyncgrpo.routing_replay import moe_routers, replay_routing, replayed_routing
from asyncgrpo.sample import Sample


def test_replayed_routing_by_hand():
    """Token 0 is replayed to experts [3, 0]: scores are the router's probabilities of those two,
    renormalized; token 1 keeps its own top-2 (experts 1, 2)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 2.0, 1.0]])
    recorded = torch.tensor([[3, 0], [0, 3]])
    scores, indices = replayed_routing(logits, recorded, torch.tensor([True, False]), 2, normalize=True)
    assert indices.tolist() == [[3, 0], [1, 2]]
    e = [math.exp(v) for v in (2.0, 1.0, 0.0, -1.0)]
    torch.testing.assert_close(scores[0], torch.tensor([e[3], e[0]]) / (e[3] + e[0]))
    torch.testing.assert_close(
        scores[1], torch.tensor([math.exp(3), math.exp(2)]) / (math.exp(3) + math.exp(2))
    )
    raw, _ = replayed_routing(logits, recorded, torch.tensor([True, True]), 2, normalize=False)
    torch.testing.assert_close(raw[0], torch.tensor([e[3], e[0]]) / sum(e))


@contextmanager
def recording(model):
    """The experts every router chose in the forwards of the block, per layer (padded forward, k)."""
    routers = moe_routers(model)
    chosen: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda m, i, out: chosen.append(out[2].detach())) for r in routers]
    try:
        yield chosen
    finally:
        for handle in handles:
            handle.remove()


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    """The "sampler" (the tiny Qwen3-MoE) and the "trainer": the same weights with every router
    perturbed, as other kernels and precision would, enough that some tokens change experts."""
    model_dir = save_tiny_model(tmp_path_factory.mktemp("qwen3_moe"), arch="qwen3_moe")
    sampler = enable_tree_attention(load_model(str(model_dir)).eval())
    trainer = enable_tree_attention(load_model(str(model_dir)).eval())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in moe_routers(trainer):
            router.weight.add_(
                0.3 * router.weight.std() * torch.randn(router.weight.shape, generator=generator)
            )
    return sampler, trainer


SHARED = 23


def group_row(vocab: int):
    """Two samples sharing a 24-token prompt, 12 generated tokens each: the prompt's first 23 tokens
    are forwarded once (the last predicts each sample's own first token, so it is not shared)."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, vocab, 24)
    samples = []
    for _ in range(2):
        tokens = np.concatenate([prompt, rng.integers(0, vocab, 12)])
        samples.append(Sample(tokens, np.arange(36) >= 24, np.zeros(12, np.float32), 1.0, 0))
    row = pack_row(samples)
    assert row.num_tokens == SHARED + 2 * 13
    return row


@pytest.fixture(scope="module")
def recorded_row(moe_pair):
    """A packed row, the sampler's log-probs and experts on it (what the server would return with
    the samples, at the row's packed positions), and the trainer's own log-probs and experts."""
    sampler, trainer = moe_pair
    row = group_row(min(sampler.config.vocab_size, 900))
    with torch.no_grad(), recording(sampler) as sampled:
        reference = row_logprobs(sampler, row).logprobs
    with torch.no_grad(), recording(trainer) as own:
        plain = row_logprobs(trainer, row).logprobs
    recorded, own = torch.stack(sampled)[:, : row.num_tokens], torch.stack(own)[:, : row.num_tokens]
    return row, reference, recorded, plain, own


def test_replay_forces_the_recorded_experts_and_the_mismatch_falls(moe_pair, recorded_row):
    _, trainer = moe_pair
    row, reference, recorded, plain, own = recorded_row
    switched = (own.sort(-1).values != recorded.sort(-1).values).any(-1)  # (layers, P)
    assert switched.any(), "the perturbation must move some tokens to other experts"
    replay = torch.ones(row.num_tokens, dtype=torch.bool)
    with torch.no_grad(), replay_routing(trainer, recorded, replay), recording(trainer) as replayed:
        forced = row_logprobs(trainer, row).logprobs
    assert torch.equal(torch.stack(replayed)[:, : row.num_tokens], recorded)  # every token, every layer
    plain_gap = (plain - reference).abs().mean()
    forced_gap = (forced - reference).abs().mean()
    print(f"routing replay: mean |log p - log q| {plain_gap:.4g} without, {forced_gap:.4g} with")
    assert forced_gap < plain_gap


def test_replay_leaves_other_tokens_to_the_router_and_gradients_reach_it(moe_pair, recorded_row):
    """Only the generated tokens replayed: the prompt keeps the trainer's own experts; the router's
    weights still get a gradient through the replayed tokens' scores."""
    _, trainer = moe_pair
    row, _, recorded, _, own = recorded_row
    replay = torch.zeros(row.num_tokens, dtype=torch.bool)
    replay[SHARED:] = True  # the packed layout: the shared prompt first, then each sample's tail
    with replay_routing(trainer, recorded, replay), recording(trainer) as replayed:
        loss = -row_logprobs(trainer, row).logprobs.sum()
    got = torch.stack(replayed)[:, : row.num_tokens]
    assert torch.equal(got[:, SHARED:], recorded[:, SHARED:])
    assert torch.equal(got[:, :SHARED], own[:, :SHARED])
    trainer.zero_grad()
    loss.backward()
    assert all(router.weight.grad.abs().sum() > 0 for router in moe_routers(trainer))


def test_replay_refuses_a_routing_of_another_model(moe_pair):
    _, trainer = moe_pair
    with pytest.raises(ValueError, match="MoE layers"):
        with replay_routing(
            trainer, torch.zeros(99, 4, 2, dtype=torch.long), torch.ones(4, dtype=torch.bool)
        ):
            pass
