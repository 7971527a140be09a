"""MoE routing replay: the scores and experts by hand; on a tiny Hugging Face Qwen3-MoE forwarding a
tree-packed row, the trainer's routing equals the recorded one on every replayed token and the
log-prob mismatch against the recording model falls; and the sampler side, a (fake) server's
routings carried by the worker's samples into the trainer's forward."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import math
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

from aiohttp import web  # noqa: E402
from test_client_faults import serve  # noqa: E402

from asyncgrpo.cli.tiny_model import save_tiny_model  # noqa: E402
from asyncgrpo.generation.client import SamplingParams, VLLMClient  # noqa: E402
from asyncgrpo.generation.responses import MalformedResponseError, decode_routed_experts  # noqa: E402
from asyncgrpo.generation.server_info import check_routing_replay, parse_server_info  # noqa: E402
from asyncgrpo.losses.token_logprobs import row_logprobs  # noqa: E402
from asyncgrpo.modeling.models import load_model  # noqa: E402
from asyncgrpo.modeling.routing_replay import moe_routers, replay_routing, replayed_routing  # noqa: E402
from asyncgrpo.packing.tree_attention import enable_tree_attention  # noqa: E402
from asyncgrpo.packing.trie import pack_row  # noqa: E402
from asyncgrpo.records.sample import Sample  # noqa: E402
from asyncgrpo.rollout.sampler import PolicySampler, RoutingNotReturnedError  # noqa: E402
from asyncgrpo.rollout.scoring import training_samples  # noqa: E402
from asyncgrpo.rollout.sequences import build_training_sequences  # noqa: E402
from asyncgrpo.rollout.types import Rollout, RolloutGroup, TurnRecord  # noqa: E402
from asyncgrpo.trainer.row_loss import replayed_routing_of  # noqa: E402


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


def group_samples(vocab: int) -> list[Sample]:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, vocab, 24)
    samples = []
    for _ in range(2):
        tokens = np.concatenate([prompt, rng.integers(0, vocab, 12)])
        samples.append(Sample(tokens, np.arange(36) >= 24, np.zeros(12, np.float32), 1.0, 0))
    return samples


def group_row(vocab: int):
    """Two samples sharing a 24-token prompt, 12 generated tokens each: the prompt's first 23 tokens
    are forwarded once (the last predicts each sample's own first token, so it is not shared)."""
    row = pack_row(group_samples(vocab))
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


def test_packing_maps_each_samples_routing_to_its_packed_tokens():
    """A = [1, 2, 3, 4] and B = [1, 2, 5, 6] share token 1 (token 2 predicts a different trained token
    in each, so it is not shared): the layout is [1, 2, 3, 4, 2, 5, 6]. Routings (1 layer, top-1) are
    recorded for all but the last token (as vLLM returns them): A [10, 11, 12], B [20, 21, 22]. The
    shared token takes A's (the first sample's) routing; the last tokens have none."""

    def sample(tokens, experts):
        routing = np.array(experts, dtype=np.uint8)[:, None, None]
        trained = np.array([False, False, True, True])
        return Sample(np.array(tokens), trained, np.zeros(2, np.float32), 1.0, 0, routed_experts=routing)

    row = pack_row([sample([1, 2, 3, 4], [10, 11, 12]), sample([1, 2, 5, 6], [20, 21, 22])])
    assert row.input_ids.tolist() == [1, 2, 3, 4, 2, 5, 6]
    assert row.routed.tolist() == [True, True, True, False, True, True, False]
    assert row.routed_experts[0, :, 0].tolist() == [10, 11, 12, 0, 21, 22, 0]
    assert (
        pack_row([Sample(np.array([1, 2]), np.array([False, True]), np.zeros(1, np.float32), 1.0, 0)]).routed
        is None
    )


def test_samples_that_carry_routings_are_trained_on_them(moe_pair):
    """The trainer's row context (`replayed_routing_of`, around forward and backward): each sample's
    routing, recorded on the sampler alone and stored compactly with it, forces the trainer's experts
    on every routed token of the packed row."""
    sampler, trainer = moe_pair
    samples = []
    for s in group_samples(min(sampler.config.vocab_size, 900)):
        with torch.no_grad(), recording(sampler) as alone:
            row_logprobs(sampler, pack_row([s]))
        routing = torch.stack(alone)[:, : s.num_tokens - 1].permute(1, 0, 2).numpy().astype(np.uint8)
        samples.append(dataclasses.replace(s, routed_experts=routing))
    packed = pack_row(samples)
    assert packed.routed.sum() == packed.num_tokens - 2  # each sample's last token has no routing
    with replayed_routing_of(trainer, packed), recording(trainer) as replayed:
        loss = -row_logprobs(trainer, packed).logprobs.sum()
        loss.backward()
    got = torch.stack(replayed[: len(moe_routers(trainer))])[:, : packed.num_tokens]
    known = torch.from_numpy(packed.routed)
    assert torch.equal(got[:, known], torch.from_numpy(packed.routed_experts)[:, known])


# -- the sampler side: a server's routings through the worker's sample into the trainer's forward ---


def fake_generate_server(answers: list[tuple[list[int], np.ndarray | None]]):
    """A token route (`/inference/v1/generate`) answering each request with the next completion and,
    when given, its routing as vLLM sends it: base64 of a `.npy` array, int32 here."""

    async def handler(request: web.Request) -> web.Response:
        tokens, routing = answers.pop(0)
        choice = {
            "token_ids": tokens,
            "logprobs": {"content": [{"token_id": t, "logprob": -1.0, "top_logprobs": []} for t in tokens]},
            "finish_reason": "length",
        }
        if routing is not None:
            buffer = io.BytesIO()
            np.save(buffer, routing.astype(np.int32))
            choice["routed_experts"] = base64.b64encode(buffer.getvalue()).decode()
        return web.json_response({"choices": [choice]})

    return handler


def sample_turns(handler, count: int, prompt: list[int], routing_replay: bool = True) -> list[TurnRecord]:
    async def run():
        runner, url = await serve(handler)
        try:
            async with VLLMClient(url, timeout=10, model="m") as client:
                policy = PolicySampler(
                    client, SimpleNamespace(value=0), None, seed=0, token_route=True, candidate_sets=False,
                    routing_replay=routing_replay,
                )  # fmt: skip
                return [await policy.turn(prompt, SamplingParams(max_tokens=12)) for _ in range(count)]
        finally:
            await runner.cleanup()

    return asyncio.run(run())


def least_likely_experts(model, tokens: np.ndarray) -> np.ndarray:
    """(len(tokens) - 1, layers, top_k): per token and layer the experts the model's router ranks
    last, so a forward that kept its own choice could not match them by chance."""
    routers = moe_routers(model)
    logits: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda m, i, out: logits.append(out[0].detach())) for r in routers]
    try:
        with torch.no_grad():
            model(input_ids=torch.from_numpy(tokens[None]))
    finally:
        for handle in handles:
            handle.remove()
    top_k = routers[0].top_k
    last = torch.stack(logits).argsort(-1)[:, : len(tokens) - 1, :top_k]  # (layers, tokens - 1, k)
    return last.permute(1, 0, 2).numpy()


def test_a_servers_routing_travels_with_the_sample_and_is_replayed_in_the_trainers_forward(moe_pair):
    """Two completions of one prompt from a fake server, each with its routing (prompt and output
    tokens but the last, int32 as vLLM sends it). The worker's sampler keeps it with the turn, the
    sequence and the queued sample (as uint8); tree packing gives the shared prompt one routing; and
    in the trainer's forward every routed token of every layer goes to the recorded experts."""
    _, trainer = moe_pair
    samples = group_samples(min(trainer.config.vocab_size, 900))
    prompt = samples[0].token_ids[:24]
    recorded = [least_likely_experts(trainer, s.token_ids) for s in samples]
    handler = fake_generate_server([(s.token_ids[24:].tolist(), r) for s, r in zip(samples, recorded)])
    turns = sample_turns(handler, len(samples), prompt.tolist())
    group = RolloutGroup(
        prompts=[[], []], reward_kwargs={}, completions=[[], []], completions_ids=[[], []],
        completions_sequences=[build_training_sequences([turn])[0] for turn in turns],
        tool_call_counts=[0, 0], tool_failure_counts=[0, 0], model_version=0, group_id=0, row_index=0,
        env_rewards=[None, None], rollout_rewards=[None, None], rewards=np.array([1.0, 0.0]),
        rollouts=[Rollout([], [], [turn]) for turn in turns],
    )  # fmt: skip
    queued = training_samples(group, np.array([1.0, -1.0]))
    for sample, routing in zip(queued, recorded):
        sample.validate()
        assert sample.routed_experts.dtype == np.uint8 and np.array_equal(sample.routed_experts, routing)
    packed = pack_row(queued)
    assert packed.routed.sum() == packed.num_tokens - 2  # each sample's last token has no routing
    with replayed_routing_of(trainer, packed), recording(trainer) as replayed:
        row_logprobs(trainer, packed)
    got = torch.stack(replayed[: len(moe_routers(trainer))])[:, : packed.num_tokens]
    known = torch.from_numpy(packed.routed)
    assert torch.equal(got[:, known], torch.from_numpy(packed.routed_experts)[:, known])


def test_a_server_that_returns_no_routing_is_an_error_that_says_how_to_start_it():
    handler = fake_generate_server([([5, 6], None)])
    with pytest.raises(RoutingNotReturnedError, match="--moe-routing-replay"):
        sample_turns(handler, 1, [1, 2, 3])
    assert sample_turns(fake_generate_server([([5, 6], None)]), 1, [1, 2, 3], routing_replay=False)
    with pytest.raises(ValueError, match="--enable-scale-out"):
        PolicySampler(None, None, None, seed=0, token_route=False, candidate_sets=False, routing_replay=True)


def test_a_server_that_does_not_return_routings_is_refused_at_start():
    def info(enabled: bool):
        return parse_server_info(
            {"vllm_config": {"aux_output_config": {"enable_return_routed_experts": enabled}}}
        )

    check_routing_replay(info(True), "http://server")
    with pytest.raises(ValueError, match="--moe-routing-replay"):
        check_routing_replay(info(False), "http://server")


def test_routings_are_decoded_into_the_narrowest_type():
    def encoded(array: np.ndarray) -> str:
        buffer = io.BytesIO()
        np.save(buffer, array)
        return base64.b64encode(buffer.getvalue()).decode()

    assert decode_routed_experts(encoded(np.full((3, 2, 2), 255, np.int32))).dtype == np.uint8
    assert decode_routed_experts(encoded(np.full((3, 2, 2), 256, np.int32))).dtype == np.uint16
    with pytest.raises(MalformedResponseError, match="expected"):
        decode_routed_experts(encoded(np.zeros((3, 2), np.int32)))
