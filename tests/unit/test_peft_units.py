"""PEFT without a server: wrapping, what is refused or served merged, the merged view, adapter files."""

from __future__ import annotations

import asyncio
import copy
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip(
    "datasets", reason="datasets is not installed (a GPU host may lack the non-torch dependencies)"
)
pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)
from datasets import Dataset
from peft import LoraConfig, PeftModel, PromptTuningConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.generation.background import BackgroundLoop
from asyncgrpo.generation.client import SamplingParams, VLLMRequestError, policy_label
from asyncgrpo.generation.server import serving_lora_rank
from asyncgrpo.losses.token_logprobs import row_logprobs
from asyncgrpo.modeling.peft_adapters import adapter_rank, adapter_unservable_reason, wrap_with_peft
from asyncgrpo.packing.trie import pack_row
from asyncgrpo.records.sample import Sample
from asyncgrpo.rollout.sampler import PolicySampler
from asyncgrpo.weight_sync.base import serving_tensors
from asyncgrpo.weight_sync.lora import LoraAdapterSync, check_lora_server
from asyncgrpo.weight_sync.merged import merged_for_serving

TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]


def load(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def trained_like(peft_model, seed: int = 0):
    """Non-zero adapter weights (B starts at zero, which would make every check trivial)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return peft_model


def reward(completion_ids, **kwargs):
    return [0.0 for _ in completion_ids]


def test_trainer_wraps_the_model_and_only_adapter_parameters_get_optimizer_state(tiny_model_dir, tmp_path):
    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", max_steps=1)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]]})
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir),
        reward,
        args,
        train_dataset=dataset,
        peft_config=LoraConfig(r=4, target_modules=TARGETS),
    )
    assert isinstance(trainer.model, PeftModel)
    optimizer = trainer.create_optimizer()
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    names = {name for name, p in trainer.model.named_parameters() if id(p) in optimized}
    assert names and all("lora_" in name for name in names)
    assert (
        len(names) == 2 * 4 * trainer.model.config.num_hidden_layers
    )  # A and B of each target in each layer


def test_gradient_checkpointing_and_tree_packing_reach_the_adapter(tiny_model_dir):
    from asyncgrpo.packing.tree_attention import enable_tree_attention

    model = wrap_with_peft(load(tiny_model_dir), LoraConfig(r=4, target_modules=TARGETS), True)
    model = enable_tree_attention(trained_like(model))
    model.gradient_checkpointing_enable()
    model.train()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 900, 10)
    samples = [
        Sample(
            np.concatenate([prompt, rng.integers(0, 900, 6)]),
            np.arange(16) >= 10,
            np.zeros(6, np.float32),
            1.0,
            0,
        )
        for _ in range(2)
    ]
    row = pack_row(samples)
    assert row.num_tokens < 32  # the prompt is shared: packed as a tree
    row_logprobs(model, row).logprobs.sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    assert grads and all(grad is not None and float(grad.abs().sum()) > 0 for grad in grads.values())
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_adapters_on_the_output_head_and_prompt_learning_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="lm_head is not supported"):
        wrap_with_peft(load(tiny_model_dir), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]), False)
    with pytest.raises(ValueError, match="lm_head is not supported"):
        wrap_with_peft(
            load(tiny_model_dir),
            LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]),
            False,
        )
    with pytest.raises(ValueError, match="prompt-learning"):
        wrap_with_peft(
            load(tiny_model_dir), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4), False
        )


def test_an_adapter_on_an_embedding_tied_to_the_output_head_is_refused(tiny_model_dir):
    """Merged for the servers, it would change the tied lm_head too: served and trained policies differ."""

    def tied():
        model = load(tiny_model_dir)
        model.lm_head.weight = model.get_input_embeddings().weight
        return model

    for config in (
        LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"]),
        LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["embed_tokens"]),
    ):
        with pytest.raises(ValueError, match="shares its weight"):
            wrap_with_peft(tied(), config, False)
        wrap_with_peft(load(tiny_model_dir), config, False)  # untied: the head is served as it is trained
    wrap_with_peft(tied(), LoraConfig(r=4, target_modules=TARGETS), False)


def test_a_bad_peft_config_is_refused_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    import asyncgrpo.trainer.async_grpo_trainer as trainer_module

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the peft_config was checked")

    monkeypatch.setattr(trainer_module.AsyncGRPOTrainer, "_load_model", staticmethod(no_loading))
    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", max_steps=1)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "q"}]]})
    with pytest.raises(ValueError, match="prompt-learning"):
        AsyncGRPOTrainer(
            str(tiny_model_dir),
            reward,
            args,
            train_dataset=dataset,
            peft_config=PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        )


@pytest.mark.parametrize(
    "config, reason",
    [
        (LoraConfig(r=4, target_modules=TARGETS), None),
        (LoraConfig(r=4, target_modules=TARGETS, use_dora=True), "DoRA"),
        (LoraConfig(r=4, target_modules=TARGETS, modules_to_save=["norm"]), "modules_to_save"),
        (LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"]), "embeddings"),
        (LoraConfig(r=4, target_modules=TARGETS, bias="lora_only"), "biases"),
        (LoraConfig(r=4, target_modules=TARGETS, init_lora_weights="pissa"), "changes the base weights"),
        (LoraConfig(r=4, target_modules=TARGETS, init_lora_weights="gaussian"), None),
        (LoraConfig(r=4, target_modules=TARGETS, alora_invocation_tokens=[5]), "alora_invocation_tokens"),
    ],
)
def test_what_vllm_cannot_serve_as_an_adapter(tiny_model_dir, config, reason):
    found = adapter_unservable_reason(get_peft_model(load(tiny_model_dir), config))
    assert found is None if reason is None else reason in found


@pytest.mark.parametrize(
    "config",
    [
        LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS),
        LoraConfig(r=4, target_modules=TARGETS, use_dora=True),
        LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"], modules_to_save=["norm"]),
    ],
)
def test_merged_view_serves_the_merged_model_under_base_names_and_restores_the_model_bit_for_bit(
    tiny_model_dir, config
):
    peft_model = trained_like(get_peft_model(load(tiny_model_dir), config))
    before = {name: t.detach().clone() for name, t in peft_model.state_dict().items()}
    reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    with merged_for_serving(peft_model) as merged:
        served = dict(serving_tensors(merged))
        assert served.keys() == dict(serving_tensors(load(tiny_model_dir))).keys()
        for name, tensor in served.items():
            torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6)
    after = peft_model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert not any(getattr(module, "merged_adapters", []) for module in peft_model.modules())


def test_server_flag_checks_name_the_flags_to_restart_with():
    assert [serving_lora_rank(r) for r in (1, 4, 8, 12, 300, 512, 513)] == [1, 8, 8, 16, 320, 512, None]
    check_lora_server(8, 3, "http://s", rank=4, max_staleness=1)
    with pytest.raises(ValueError) as raised:
        check_lora_server(8, 2, "http://s", rank=12, max_staleness=4)
    message = str(raised.value)
    assert "below the adapter's rank r=12" in message and "below max_staleness + 2 = 6" in message
    assert "--enable-lora --max-lora-rank 16 --max-loras 6" in message
    with pytest.raises(ValueError, match="not one of vLLM's values"):
        check_lora_server(4, 6, "http://s", rank=4, max_staleness=4)


def test_adapter_versions_are_written_as_loadable_adapters(tiny_model_dir, tmp_path):
    peft_model = trained_like(
        get_peft_model(load(tiny_model_dir), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    )
    assert adapter_rank(peft_model) == 4
    backend = LoraAdapterSync(None, None, None, keep=2, is_sender=False)
    backend.is_sender, backend.directory = True, tmp_path / ".vllm_lora"  # prepare() only: no server
    folder = backend.prepare(peft_model, 3)
    assert folder == tmp_path / ".vllm_lora" / "v3" and sorted(p.name for p in folder.parent.iterdir()) == [
        "v3"
    ]
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 4
    saved = load_file(folder / "adapter_model.safetensors")
    assert all(name.startswith("base_model.model.") and ".default." not in name for name in saved)
    reloaded = PeftModel.from_pretrained(load(tiny_model_dir), folder)
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, peft_model(input_ids=ids).logits)


class RecordingServers:
    """The adapter calls a sync makes, in order, and which adapter folders exist at each call; a
    `missing` name answers 404, as from a server restarted since it loaded that version."""

    base_urls = ["http://s"]

    def __init__(self, directory, missing=()):
        self.directory, self.missing, self.calls = directory, set(missing), []

    def _folders(self):
        return sorted(path.name for path in self.directory.iterdir())

    async def load_lora_adapter(self, name, path, load_inplace=False, urls=None):
        self.calls.append(("load", name, load_inplace, self._folders()))
        return []  # every server reached

    async def unload_lora_adapter(self, name, urls=None):
        self.calls.append(("unload", name, self._folders()))
        if name in self.missing:
            raise VLLMRequestError("http://s/v1/unload_lora_adapter", 404, "not found")
        return []

    async def set_weight_label(self, label, urls=None):
        self.calls.append(("label", label))
        return []


def test_each_sync_loads_the_next_version_before_unloading_the_oldest_and_deletes_its_folder(
    tiny_model_dir, tmp_path
):
    peft_model = trained_like(get_peft_model(load(tiny_model_dir), LoraConfig(r=4, target_modules=TARGETS)))
    servers = RecordingServers(tmp_path / ".vllm_lora", missing={"run-v1"})
    loop = BackgroundLoop()
    try:
        backend = LoraAdapterSync(servers, loop, tmp_path / ".vllm_lora", keep=2)  # max_staleness = 1
        backend.prefix = "run"
        for version in range(4):
            backend.sync(peft_model, version)
        backend.sync(peft_model, 3)  # the same version again: pushed in place to a restarted server
        assert sorted(p.name for p in backend.directory.iterdir()) == ["v2", "v3"]
        backend.close()
    finally:
        loop.close()
    assert servers.calls == [
        ("load", "run-v0", False, ["v0"]),
        ("label", policy_label(0)),
        ("load", "run-v1", False, ["v0", "v1"]),
        ("label", policy_label(1)),
        ("load", "run-v2", False, ["v0", "v1", "v2"]),  # three loaded for a moment: --max-loras >= 3
        ("label", policy_label(2)),
        ("unload", "run-v0", ["v0", "v1", "v2"]),
        ("load", "run-v3", False, ["v1", "v2", "v3"]),
        ("label", policy_label(3)),
        ("unload", "run-v1", ["v1", "v2", "v3"]),  # 404 (gone from a restarted server): not an error
        ("load", "run-v3", True, ["v2", "v3"]),
        ("label", policy_label(3)),
        ("unload", "run-v2", ["v2", "v3"]),  # close(): the run's adapters and the serving cache go
        ("unload", "run-v3", ["v3"]),
    ]
    assert not backend.directory.exists()


def test_a_server_that_joins_loads_the_newest_adapter_in_place(tiny_model_dir, tmp_path):
    """Adapter-only sync keeps the newest adapter loaded: a server back after a loss (it lost its
    adapters) or new loads it, and gets its label; nothing else is loaded or unloaded."""
    peft_model = trained_like(get_peft_model(load(tiny_model_dir), LoraConfig(r=4, target_modules=TARGETS)))
    servers = RecordingServers(tmp_path / ".vllm_lora")
    loop = BackgroundLoop()
    try:
        backend = LoraAdapterSync(servers, loop, tmp_path / ".vllm_lora", keep=2)
        backend.prefix = "run"
        for version in range(2):
            backend.sync(peft_model, version)
        assert backend.can_resend and backend.resend(1, ["http://back"]) == []
        assert servers.calls[-2:] == [("load", "run-v1", True, ["v0", "v1"]), ("label", policy_label(1))]
        assert [version for version, _ in backend.loaded] == [0, 1]
        backend.close()
    finally:
        loop.close()


class VersionedServer:
    """Answers each request with the adapter it named; `retired` names answer 404 (unloaded by a
    sync), and the trainer publishes `next_version` when one is refused."""

    def __init__(self, channels, retired=(), next_version=None):
        self.channels, self.retired, self.next_version, self.models = channels, set(retired), next_version, []

    async def complete(self, prompt_ids, sampling, seed, model=None, cache_salt=None):
        self.models.append(model)
        if model in self.retired:
            self.channels.model_version_value.value = self.next_version
            raise VLLMRequestError("http://s/v1/completions", 404, f"The model `{model}` does not exist.")
        return model


def policy_sampler(version: int, lora_name: str | None) -> tuple[PolicySampler, SimpleNamespace]:
    channels = SimpleNamespace(model_version_value=SimpleNamespace(value=version))
    sampler = PolicySampler(
        None, channels.model_version_value, lora_name, seed=0, token_route=False, candidate_sets=False
    )
    return sampler, channels


def test_each_request_runs_under_the_adapter_of_the_version_current_when_it_starts():
    sampler, channels = policy_sampler(5, lora_name="run")
    sampler.client = VersionedServer(channels)
    assert asyncio.run(sampler.sample([1, 2], SamplingParams(max_tokens=4), 0)) == ("run-v5", 5)
    # Read just before a sync retired version 5: sent again under the version published since.
    sampler.client = VersionedServer(channels, retired={"run-v5"}, next_version=6)
    assert asyncio.run(sampler.sample([1, 2], SamplingParams(max_tokens=4), 0)) == ("run-v6", 6)
    assert sampler.client.models == ["run-v5", "run-v6"]
    # Merged or full-model sync: every request goes to the served model, whose weights change in place.
    sampler, channels = policy_sampler(5, lora_name=None)
    sampler.client = VersionedServer(channels, retired={None})
    with pytest.raises(VLLMRequestError):
        asyncio.run(sampler.sample([1, 2], SamplingParams(max_tokens=4), 0))
    assert sampler.client.models == [None]


def test_one_factory_chooses_the_senders_backend(tiny_model_dir, tmp_path):
    """make_sender: the adapter alone when the servers run --enable-lora, else the requested backend
    (auto: the filesystem without a GPU); an explicit nccl needs a server running the NCCL engine."""
    from types import SimpleNamespace

    from asyncgrpo.generation.server_info import ServerInfo
    from asyncgrpo.weight_sync import FilesystemWeightSync, make_sender, make_weight_sync

    client, loop = SimpleNamespace(base_urls=["http://server:8000"]), SimpleNamespace()
    plain = load(tiny_model_dir)
    adapted = get_peft_model(load(tiny_model_dir), LoraConfig(r=8, target_modules=TARGETS))
    lora_server = ServerInfo(max_lora_rank=16, max_loras=4)

    def sender(model, info, requested="auto"):
        return make_sender(requested, model, info, client, loop, tmp_path, 5.0, 1, trainer_on_gpu=False)

    assert isinstance(sender(adapted, lora_server), LoraAdapterSync)
    assert isinstance(sender(adapted, ServerInfo()), FilesystemWeightSync)  # no --enable-lora: merged
    chosen = sender(plain, lora_server)
    assert isinstance(chosen, FilesystemWeightSync) and chosen.timeout_s == 5.0
    assert chosen.directory == (tmp_path / ".vllm_weights").resolve()
    with pytest.raises(ValueError, match="not started with the NCCL engine"):
        sender(plain, ServerInfo(), requested="nccl")
    assert make_weight_sync(chosen.name, is_sender=False).is_sender is False
