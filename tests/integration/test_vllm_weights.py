"""New weights reach a real vLLM server: reload from a directory, and runtime LoRA adapters."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from asyncgrpo.generation.client import SamplingParams, VLLMClient, policy_cache_salt, policy_label  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPT = [952, 648, 198, 287, 260, 294, 10, 18, 30, 950, 198, 952, 653, 198]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, num_top_logprobs=0)


def greedy_reference(model, prompt: list[int], num_tokens: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and their log-probs from transformers, one forward per token."""
    ids = list(prompt)
    logprobs = []
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return ids[len(prompt) :], np.array(logprobs, dtype=np.float32)


def perturbed_copy(model_dir, out_dir, seed: int):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    model.save_pretrained(out_dir)
    return model.eval()


def test_reload_weights_from_directory_serves_the_new_weights(vllm_server, tiny_model_dir, tmp_path):
    new_model = perturbed_copy(tiny_model_dir, tmp_path / "v1", seed=1)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    async def scenario():
        async with VLLMClient(vllm_server.url, timeout=60) as client:
            before = await client.complete(PROMPT, GREEDY, seed=0)
            await client.pause(mode="keep")
            try:
                await client.reload_weights(str(tmp_path / "v1"), version="1")
            finally:
                await client.resume()  # never leave the shared server paused
            after = await client.complete(PROMPT, GREEDY, seed=0)
            # Restore the shared server for the tests that follow.
            await client.reload_weights(str(tiny_model_dir), version=policy_label(0))
            await client.reset_prefix_cache()  # these requests are unsalted: drop v1's cached prefixes
            restored = await client.complete(PROMPT, GREEDY, seed=0)
            return before, after, restored

    before, after, restored = asyncio.run(scenario())
    expected_tokens, expected_logprobs = greedy_reference(new_model, PROMPT, 20)
    assert after.token_ids.tolist() == expected_tokens
    np.testing.assert_allclose(after.logprobs, expected_logprobs, atol=1e-4)
    assert before.token_ids.tolist() != after.token_ids.tolist()
    original_tokens, _ = greedy_reference(original, PROMPT, 20)
    assert before.token_ids.tolist() == original_tokens == restored.token_ids.tolist()


def test_after_a_sync_without_a_cache_clear_the_new_version_never_reuses_old_prefixes(
    vllm_server, tiny_model_dir, tmp_path
):
    """The trainer pauses without clearing caches (frozen requests keep their KV) and sends each
    request's policy version as its cache salt. A prompt spanning several KV blocks, cached under
    version 0, must then run entirely on the new weights under version 1's salt; the control, the
    same prompt under version 0's salt, shows the old blocks really were still cached."""
    new_model = perturbed_copy(tiny_model_dir, tmp_path / "v1", seed=2)
    long_prompt = [
        int(token) for token in torch.randint(10, 900, (600,), generator=torch.Generator().manual_seed(0))
    ]
    one_token = SamplingParams(max_tokens=4, temperature=0.0, num_top_logprobs=0)

    async def scenario():
        async with VLLMClient(vllm_server.url, timeout=60) as client:
            await client.complete(long_prompt, one_token, seed=0, cache_salt=policy_cache_salt(0))
            await client.pause(mode="keep")
            try:
                await client.reload_weights(str(tmp_path / "v1"), version="1")
            finally:
                await client.resume()  # never leave the shared server paused
            fresh = await client.complete(long_prompt, one_token, seed=0, cache_salt=policy_cache_salt(1))
            stale = await client.complete(long_prompt, one_token, seed=0, cache_salt=policy_cache_salt(0))
            await client.reload_weights(str(tiny_model_dir), version=policy_label(0))
            await client.reset_prefix_cache()  # no request holds blocks now: leave no stale prefix behind
            return fresh, stale

    fresh, stale = asyncio.run(scenario())
    expected_tokens, expected_logprobs = greedy_reference(new_model, long_prompt, 4)
    assert fresh.token_ids.tolist() == expected_tokens
    np.testing.assert_allclose(fresh.logprobs, expected_logprobs, atol=1e-4)
    assert np.abs(stale.logprobs - expected_logprobs).max() > 1e-3  # reused KV of the old weights


def test_runtime_lora_adapter_matches_merged_model(lora_server, tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
    )
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:  # B starts at zero: make the adapter change something
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    peft_model.save_pretrained(tmp_path / "adapter")
    merged = peft_model.merge_and_unload().eval()

    async def scenario():
        async with VLLMClient(lora_server.url, timeout=60) as client:
            base_out = await client.complete(PROMPT, GREEDY, seed=0)
            await client.load_lora_adapter("policy-1", str(tmp_path / "adapter"))
            adapter_out = await client.complete(PROMPT, GREEDY, seed=0, model="policy-1")
            await client.unload_lora_adapter("policy-1")
            return base_out, adapter_out

    base_out, adapter_out = asyncio.run(scenario())
    expected_tokens, expected_logprobs = greedy_reference(merged, PROMPT, 20)
    assert adapter_out.token_ids.tolist() == expected_tokens
    np.testing.assert_allclose(adapter_out.logprobs, expected_logprobs, atol=1e-4)
    assert base_out.token_ids.tolist() != adapter_out.token_ids.tolist()
