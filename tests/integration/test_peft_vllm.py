"""PEFT training against real vLLM CPU servers: adapter-only sync (`--enable-lora`) and merged sync."""

from __future__ import annotations

import asyncio
import copy
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_config
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from test_trainer_e2e import PROBE, prompts, restore_server, token_parity_reward
from test_vllm_weights import greedy_reference
from transformers import AutoModelForCausalLM, TrainerCallback

from asyncgrpo import AsyncGRPOTrainer
from asyncgrpo.checkpoints.layout import ShardedManifest
from asyncgrpo.checkpoints.sharded_state import model_tensor_shapes
from asyncgrpo.cli.main import main as cli_main
from asyncgrpo.generation.background import BackgroundLoop
from asyncgrpo.generation.client import SamplingParams, VLLMClient, VLLMRequestError, policy_adapter_name
from asyncgrpo.weight_sync import make_weight_sync
from asyncgrpo.weight_sync.lora import LoraAdapterSync, adapter_sync_for
from asyncgrpo.weight_sync.merged import sync_policy

pytestmark = pytest.mark.vllm

TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def served(url: str, model: str | None = None, sampling: SamplingParams = GREEDY):
    async def run():
        async with VLLMClient(url, timeout=60) as client:
            return await client.complete(PROBE, sampling, seed=0, model=model)

    return asyncio.run(run())


def served_models(url: str) -> list[str]:
    async def run():
        async with VLLMClient(url, timeout=60) as client:
            return [card["id"] for card in await client.models()]

    return asyncio.run(run())


def merged_copy(peft_model):
    return copy.deepcopy(peft_model).merge_and_unload().eval()


class AtLastStep(TrainerCallback):
    """What the server runs right after the last step's sync, before the trainer tears down."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.seen = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step < args.max_steps:
            return
        backend = self.trainer.weight_transfer
        newest = policy_adapter_name(backend.prefix, self.trainer.model_version)
        self.seen = dict(
            newest=newest,
            models=served_models(args.vllm_server_urls[0]),
            folders=sorted(path.name for path in backend.directory.iterdir()),
            completion=served(args.vllm_server_urls[0], newest),
            reference=greedy_reference(merged_copy(self.trainer.model), PROBE, GREEDY.max_tokens),
        )


def test_adapter_only_sync_trains_and_the_server_runs_the_newest_adapter(
    lora_server, tiny_model_dir, tmp_path
):
    base_before = served(lora_server.url)
    # Gradient checkpointing on: the checkpointed layers must still pass gradients to the adapter.
    args = make_config(
        lora_server,
        tmp_path,
        max_steps=3,
        learning_rate=5e-2,
        max_grad_norm=0.0,
        max_staleness=0,
        gradient_checkpointing=True,
    )
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir), token_parity_reward, args, train_dataset=prompts(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS),
    )  # fmt: skip
    probe = AtLastStep(trainer)
    trainer.add_callback(probe)
    trainer.train()

    assert isinstance(trainer.weight_transfer, LoraAdapterSync)
    seen = probe.seen
    # Only the newest version (max_staleness + 1 = 1) is loaded; older ones and their folders are gone.
    assert [name for name in seen["models"] if name.startswith(trainer.weight_transfer.prefix)] == [
        seen["newest"]
    ]
    assert seen["folders"] == [f"v{trainer.model_version}"] and trainer.model_version == 3
    expected_tokens, expected_logprobs = seen["reference"]
    assert seen["completion"].token_ids.tolist() == expected_tokens
    np.testing.assert_allclose(seen["completion"].logprobs, expected_logprobs, atol=1e-4)
    assert expected_tokens != base_before.token_ids.tolist(), "training must have moved the adapter"
    # The rollouts ran under the adapter of their version (max_staleness=0: the trainer's): the sampler's
    # log-probs are the trainer's, also after training moved the adapter away from the base model.
    gaps = [
        entry["sampling/sampling_logp_difference/max"]
        for entry in trainer.state.log_history
        if "sampling/sampling_logp_difference/max" in entry
    ]
    assert len(gaps) == 3 and max(gaps) < 1e-3, gaps
    # The base model is untouched and the run's adapters are unloaded at the end.
    assert served(lora_server.url).token_ids.tolist() == base_before.token_ids.tolist()
    assert not any(name.startswith(trainer.weight_transfer.prefix) for name in served_models(lora_server.url))
    assert not (tmp_path / ".vllm_lora").exists()
    adapter_bytes = sum(p.numel() * 4 for name, p in trainer.model.named_parameters() if "lora_" in name)
    logged = [
        entry["perf/weight_sync_bytes"]
        for entry in trainer.state.log_history
        if "perf/weight_sync_bytes" in entry
    ]
    assert logged and all(value == adapter_bytes for value in logged)
    assert all(
        entry["perf/weight_sync_s"] >= 0
        for entry in trainer.state.log_history
        if "perf/weight_sync_s" in entry
    )


def test_versions_stay_loaded_for_their_window_and_a_request_in_flight_finishes_under_its_version(
    lora_server, tiny_model_dir, tmp_path
):
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS),
    )
    long = SamplingParams(max_tokens=600, temperature=0.0)
    loop = BackgroundLoop()
    client = VLLMClient(lora_server.url, timeout=120)
    backend = LoraAdapterSync(client, loop, tmp_path / ".vllm_lora", keep=2)  # max_staleness = 1
    generator = torch.Generator().manual_seed(0)
    try:
        for version in range(4):
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    if "lora_B" in name:
                        parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
            if version == 3:  # a long rollout under version 1 is running when version 3 retires it
                in_flight = loop.submit(
                    client.complete(PROBE, long, seed=0, model=policy_adapter_name(backend.prefix, 1))
                )
            backend.sync(model, version)
            if version == 1:
                alone = loop.run(
                    client.complete(PROBE, long, seed=0, model=policy_adapter_name(backend.prefix, 1))
                )
        loaded = [card["id"] for card in loop.run(client.models()) if card["id"].startswith(backend.prefix)]
        assert sorted(loaded) == [
            policy_adapter_name(backend.prefix, 2),
            policy_adapter_name(backend.prefix, 3),
        ]
        assert sorted(path.name for path in backend.directory.iterdir()) == ["v2", "v3"]
        finished = in_flight.result(timeout=120)
        assert finished.token_ids.tolist() == alone.token_ids.tolist()  # all of it under version 1
        with pytest.raises(VLLMRequestError) as retired:
            loop.run(client.complete(PROBE, GREEDY, seed=0, model=policy_adapter_name(backend.prefix, 1)))
        assert retired.value.status == 404
    finally:
        backend.close()
        loop.run(client.close())
        loop.close()
    assert not backend.directory.exists()


def test_server_flags_too_small_fail_with_the_flags_to_restart_with(lora_server, tiny_model_dir, tmp_path):
    for config, max_staleness, advice in [
        (LoraConfig(r=4, target_modules=TARGETS), 1, "--max-lora-rank 8 --max-loras 3"),
        (LoraConfig(r=16, target_modules=TARGETS), 0, "--max-lora-rank 16 --max-loras 2"),
    ]:
        args = make_config(lora_server, tmp_path, max_steps=1, max_staleness=max_staleness)
        trainer = AsyncGRPOTrainer(
            str(tiny_model_dir), token_parity_reward, args, train_dataset=prompts(4), peft_config=config
        )
        with pytest.raises(ValueError, match=advice):
            trainer.train()


def test_an_adapter_vllm_cannot_serve_falls_back_to_merged_sync_with_a_warning(
    lora_server, tiny_model_dir, tmp_path, caplog
):
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
        LoraConfig(r=4, target_modules=TARGETS, use_dora=True),
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:  # B starts at zero: make the adapter change something
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    base_before = served(lora_server.url)
    loop = BackgroundLoop()
    client = VLLMClient(lora_server.url, timeout=60)
    try:
        with caplog.at_level(logging.WARNING):
            backend = adapter_sync_for(model, loop.run(client.server_info()), client, loop, Path("unused"), 0)
        assert backend is None
        # The fallback: merged weights through the ordinary backend, into the server run with --enable-lora.
        sync_policy(make_weight_sync("filesystem", client, loop, tmp_path), model, 1)
        after = served(lora_server.url)
    finally:
        loop.run(client.close())
        loop.close()
        restore_server(lora_server.url, tiny_model_dir)
    warnings = [
        r.message for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("asyncgrpo")
    ]
    assert len(warnings) == 1 and "DoRA" in warnings[0] and "merged weights" in warnings[0]
    expected_tokens, expected_logprobs = greedy_reference(merged_copy(model), PROBE, GREEDY.max_tokens)
    assert after.token_ids.tolist() == expected_tokens != base_before.token_ids.tolist()
    np.testing.assert_allclose(after.logprobs, expected_logprobs, atol=1e-4)


class AdapterAtBegin(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer
        self.adapter = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.adapter = {
            n: p.detach().clone() for n, p in self.trainer.model.named_parameters() if "lora_" in n
        }


def test_merged_sync_serves_the_merged_model_and_checkpoints_hold_the_adapter(
    vllm_server, tiny_model_dir, tmp_path
):
    base_before = served(vllm_server.url)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)
    args = make_config(
        vllm_server,
        tmp_path,
        max_steps=2,
        learning_rate=5e-2,
        max_grad_norm=0.0,
        save_strategy="steps",
        save_steps=2,
    )
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir), token_parity_reward, args, train_dataset=prompts(), peft_config=config
    )
    base_weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    try:
        trainer.train()
        after = served(vllm_server.url)
        resumed_args = make_config(vllm_server, tmp_path, max_steps=3, save_strategy="no")
        resumed = AsyncGRPOTrainer(
            str(tiny_model_dir),
            token_parity_reward,
            resumed_args,
            train_dataset=prompts(),
            peft_config=config,
        )
        begin = AdapterAtBegin(resumed)
        resumed.add_callback(begin)
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    finally:
        restore_server(vllm_server.url, tiny_model_dir)
    expected_tokens, expected_logprobs = greedy_reference(
        merged_copy(trainer.model), PROBE, GREEDY.max_tokens
    )
    assert after.token_ids.tolist() == expected_tokens != base_before.token_ids.tolist()
    np.testing.assert_allclose(after.logprobs, expected_logprobs, atol=1e-4)
    # Merging for the syncs left the frozen base bit for bit as it was.
    assert all(
        torch.equal(p, base_weights[n]) for n, p in trainer.model.named_parameters() if "lora_" not in n
    )
    full_bytes = sum(
        p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict().values()
    )
    assert {
        e["perf/weight_sync_bytes"] for e in trainer.state.log_history if "perf/weight_sync_bytes" in e
    } == {full_bytes}
    sync_seconds = [e["perf/weight_sync_s"] for e in trainer.state.log_history if "perf/weight_sync_s" in e]
    assert len(sync_seconds) == 2 and all(seconds > 0 for seconds in sync_seconds)
    # The checkpoint holds the trained adapter (not the base), loadable with PeftModel.from_pretrained ...
    checkpoint = tmp_path / "checkpoint-2"
    assert (checkpoint / "adapter_model.safetensors").exists() and not (
        checkpoint / "model.safetensors"
    ).exists()
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), checkpoint
    )
    trained = {n: p for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert {n: p for n, p in loaded.named_parameters() if "lora_" in n}.keys() == trained.keys()
    assert all(torch.equal(p, trained[n]) for n, p in loaded.named_parameters() if "lora_" in n)
    assert len(load_file(checkpoint / "adapter_model.safetensors")) == len(trained)
    # ... and resuming starts from it.
    assert resumed.state.global_step == 3
    assert begin.adapter.keys() == trained.keys()
    assert all(torch.equal(begin.adapter[n], trained[n]) for n in trained)


def test_fsdp2_two_processes_train_a_lora_adapter_with_merged_sync(
    vllm_server, tiny_model_dir, tmp_path, monkeypatch
):
    """torchrun, two CPU processes over gloo: the adapter is sharded with the model, the merged
    weights are gathered for the sync, and the checkpoint holds the adapter's shards, exported as an
    adapter folder."""
    from test_multi_process import torchrun

    base_before = served(vllm_server.url)
    monkeypatch.setenv("ASYNCGRPO_TEST_LORA", "1")
    try:
        result = torchrun(
            "multi_process_train.py", vllm_server.url, str(tiny_model_dir), str(tmp_path), "2", timeout=600
        )
        after = served(vllm_server.url)
    finally:
        restore_server(vllm_server.url, tiny_model_dir)
    assert result.returncode == 0, result.stderr[-5000:]
    # The sharded checkpoint holds the adapter alone (the frozen base comes from the model again); its
    # export is the adapter's folder.
    checkpoint = tmp_path / "checkpoint-2"
    assert ShardedManifest.load(checkpoint).peft_adapter == "default"
    assert all("lora_" in name for name in model_tensor_shapes(checkpoint))
    exported = tmp_path / "adapter"
    assert cli_main(["export", str(checkpoint), str(exported)]) == 0
    assert (exported / "adapter_model.safetensors").exists() and not (exported / "model.safetensors").exists()
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), exported
    )
    assert any(float(p.abs().sum()) > 0 for n, p in loaded.named_parameters() if "lora_B" in n), (
        "the adapter trained"
    )
    # save_model on both ranks: the adapter, gathered (the same as the last checkpoint's).
    saved = load_file(tmp_path / "model-2" / "adapter_model.safetensors")
    assert saved.keys() == load_file(exported / "adapter_model.safetensors").keys()
    assert all(
        torch.equal(tensor, load_file(exported / "adapter_model.safetensors")[name])
        for name, tensor in saved.items()
    )
    # The server runs the gathered, merged model: the checkpointed adapter merged into the base.
    expected_tokens, _ = greedy_reference(merged_copy(loaded), PROBE, GREEDY.max_tokens)
    assert after.token_ids.tolist() == expected_tokens != base_before.token_ids.tolist()
