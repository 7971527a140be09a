"""The training side on one GPU: tree-attention correctness, tree vs plain packing speed, MFU, memory.

One call checks and times everything (device time is scarce) and prints a short table last:
  1. the card's bf16 matmul peak (8192^3, CUDA events), the ceiling MFU is measured against;
  2. correctness in bf16: tree-packed log-probs vs forwarding each sample alone (plain HF forward
     with SDPA) for Qwen3-0.6B- and 1.7B-shaped models (random weights from their public configs),
     and compiled flex attention vs a dense fp32 reference on fresh random inputs;
  3. forward+backward tokens/s of tree packing vs plain padding-free packing of the same GRPO groups
     (one prompt + 8 completions) at packing ratios ~1, 2, 3.4 and 6;
  4. MFU of forward+backward for the 1.7B shape on rows of 8k-32k tokens;
  5. peak memory per row vs token_budget for 1.7B with gradient checkpointing, up to the first OOM.
Weights are bf16 (pure bf16 compute); optimizer states are not allocated (add 2 x 4 bytes per
parameter for AdamW in fp32, 1.7B -> 13.6 GB, or 4 bytes with bf16 states).

Run (GPU machine): `python bench/gpu_training.py --out $OUT`; `--smoke` runs tiny shapes on CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from workloads import make_groups, plain_row  # noqa: E402

from asyncgrpo.losses.token_logprobs import row_logprobs  # noqa: E402
from asyncgrpo.modeling.perf import flop_model  # noqa: E402
from asyncgrpo.packing.tree_attention import (  # noqa: E402
    BLOCK_SIZE,
    build_tree_block_mask,
    enable_tree_attention,
    tree_attention,
)
from asyncgrpo.packing.trie import pack_row  # noqa: E402
from asyncgrpo.trainer.compile import compile_decoder_layers  # noqa: E402

QWEN3 = {  # public config.json values
    "0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28),
    "1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28),
}
QWEN3_COMMON = dict(
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1_000_000,
    rms_norm_eps=1e-6, max_position_embeddings=262_144, tie_word_embeddings=True,
)  # fmt: skip
# Qwen/Qwen3.5-2B's text_config (its config.json): 24 layers, 3 Gated DeltaNet to 1 gated full attention.
QWEN3_5_2B = dict(
    vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6, num_attention_heads=8,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
    max_position_embeddings=262_144, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
)  # fmt: skip
# (prompt, completion, groups per row) -> packing ratio 8 (P + C) / (P + 8 C) roughly 1, 2, 3.4, 6
SPEED_WORKLOADS = [(16, 1024, 2), (683, 512, 3), (1068, 256, 4), (2560, 128, 3)]


def log(message: str) -> None:
    print(message, flush=True)


def build(shape: str, device, smoke: bool, checkpointing: bool = False) -> Qwen3ForCausalLM:
    values = dict(QWEN3_COMMON, **QWEN3[shape])
    if smoke:
        values.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=1024)  # fmt: skip
    config = Qwen3Config(**values, dtype="bfloat16", attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def cuda_time(fn, repeats: int, warmup: int = 2) -> float:
    """Median seconds per call, timed with CUDA events (or the host clock on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def require_cuda(smoke: bool | None) -> None:
    """Stop a GPU benchmark run without a GPU (it would run the full shapes on CPU for hours).
    smoke: the script's --smoke flag, None for a script that has none."""
    if smoke or torch.cuda.is_available():
        return
    hint = "" if smoke is None else ", or with --smoke to check it runs on tiny shapes on CPU"
    sys.exit(
        f"{Path(sys.argv[0]).name} measures a CUDA GPU and none is visible: run it on a GPU machine{hint}"
    )


def matmul_peak(device) -> float:
    n = 8192 if device.type == "cuda" else 512
    inputs = [
        (
            torch.randn(n, n, device=device, dtype=torch.bfloat16),
            torch.randn(n, n, device=device, dtype=torch.bfloat16),
        )
        for _ in range(3)
    ]
    index = iter(range(10**9))

    def run():
        a, b = inputs[next(index) % 3]
        torch.mm(a, b)

    seconds = cuda_time(run, repeats=20, warmup=5)
    return 2 * n**3 / seconds


def per_sample_logprobs(model, samples) -> list[torch.Tensor]:
    """The reference: each sample alone through the plain HF forward (SDPA, causal)."""
    device = model.device
    out = []
    with torch.no_grad():
        for sample in samples:
            ids = torch.from_numpy(sample.token_ids).to(device)[None]
            logits = model(input_ids=ids).logits[0].float()
            targets = torch.from_numpy(np.flatnonzero(sample.trained)).to(device)
            out.append(torch.log_softmax(logits[targets - 1], -1).gather(1, ids[0, targets][:, None])[:, 0])
    return out


def check_correctness(shape: str, device, smoke: bool) -> dict:
    model = build(shape, device, smoke)
    rng = np.random.default_rng(1)
    samples = []
    for group in range(2):
        prompt = rng.integers(0, model.config.vocab_size, 300)
        for _ in range(8):
            completion = rng.integers(0, model.config.vocab_size, int(rng.integers(50, 400)))
            tokens = np.concatenate([prompt, completion])
            trained = np.arange(len(tokens)) >= len(prompt)
            from asyncgrpo.records.sample import Sample

            samples.append(Sample(tokens, trained, np.zeros(int(trained.sum()), np.float32), 1.0, group))
    reference = torch.cat(per_sample_logprobs(model, samples))
    enable_tree_attention(model)
    with torch.no_grad():
        packed = row_logprobs(model, pack_row(samples)).logprobs.float()
    difference = (packed - reference).abs()
    return {
        "shape": shape,
        "tokens": int(sum(s.num_tokens for s in samples)),
        "max_abs_diff": float(difference.max()),
        "mean_abs_diff": float(difference.mean()),
        "mean_abs_logprob": float(reference.abs().mean()),
    }


def check_flex_vs_dense(device, trials: int = 4) -> float:
    """Worst relative error of compiled tree attention vs dense fp32 masked attention."""
    worst = 0.0
    rng = np.random.default_rng(2)
    for trial in range(trials):
        samples = make_groups(rng, 2, int(rng.integers(50, 600)), int(rng.integers(30, 300)), 1000)
        row = pack_row(samples)
        length = row.num_tokens
        subtree_end = torch.from_numpy(row.subtree_end).to(device)
        positions = torch.from_numpy(row.position_ids).to(device)
        mask = build_tree_block_mask(subtree_end, positions)
        q = torch.randn(1, 16, mask.shape[-2], 128, device=device, dtype=torch.bfloat16)
        k = torch.randn(1, 8, mask.shape[-2], 128, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        out = tree_attention(q, k, v, mask)[:, :, :length].float()
        index = torch.arange(length, device=device)
        allowed = (index[None, :] <= index[:, None]) & (index[:, None] < subtree_end[None, :])
        qf, kf, vf = (t[:, :, :length].float() for t in (q, k, v))
        kf, vf = kf.repeat_interleave(2, 1), vf.repeat_interleave(2, 1)
        scores = (qf @ kf.transpose(-1, -2)) / math.sqrt(128)
        reference = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ vf
        worst = max(worst, float((out - reference).norm() / reference.norm()))
        del trial
    return worst


def fwd_bwd(model, row) -> None:
    model.zero_grad(set_to_none=True)
    row_logprobs(model, row).logprobs.sum().backward()


def compare_packings(model, flops, rng, workload, smoke: bool, peak: float, repeats: int) -> dict:
    """Tree vs plain padding-free packing of the same GRPO groups, through the same code."""
    prompt_len, completion_len, groups = workload
    if smoke:
        prompt_len, completion_len, groups = max(prompt_len // 16, 2), max(completion_len // 16, 2), 1
    samples = make_groups(rng, groups, prompt_len, completion_len, model.config.vocab_size)
    tree, plain = pack_row(samples, min_shared_tokens=BLOCK_SIZE), plain_row(samples)  # as the trainer packs
    tree_s = cuda_time(lambda: fwd_bwd(model, tree), repeats)
    plain_s = cuda_time(lambda: fwd_bwd(model, plain), repeats)
    tree_flops = flops.step_flops(tree.num_tokens, tree.num_entries, tree.attention_cost)
    plain_flops = flops.step_flops(plain.num_tokens, plain.num_entries, plain.attention_cost)
    return {
        "prompt": prompt_len,
        "completion": completion_len,
        "ratio": tree.packing_ratio,
        "tree_tokens": tree.num_tokens,
        "unpacked_tokens": tree.num_unpacked_tokens,
        "tree_tokens_per_s": tree.num_unpacked_tokens / tree_s,
        "plain_tokens_per_s": tree.num_unpacked_tokens / plain_s,
        "speedup": plain_s / tree_s,
        "flop_ratio": plain_flops / tree_flops,
        "tree_mfu": tree_flops / tree_s / peak,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else 0.0,
    }


def mfu_row(model, flops, rng, budget: int, smoke: bool, peak: float, repeats: int) -> dict:
    """fwd+bwd model FLOP/s on a realistic row: groups of a 512-token prompt + 8 x 1,024 tokens."""
    completion = 1024 if not smoke else 16
    groups = max(1, budget // (512 + 8 * completion)) if not smoke else 1
    row = pack_row(make_groups(rng, groups, 512 if not smoke else 8, completion, model.config.vocab_size))
    seconds = cuda_time(lambda: fwd_bwd(model, row), repeats)
    model_flops = flops.step_flops(row.num_tokens, row.num_entries, row.attention_cost)
    return {"token_budget": budget, "row_tokens": row.num_tokens, "seconds": seconds,
            "tflops": model_flops / seconds / 1e12, "mfu": model_flops / seconds / peak}  # fmt: skip


def speed(shape: str, device, smoke: bool, peak: float, repeats: int) -> list[dict]:
    # Activation checkpointing (the trainer's default): an unpacked 64k-token row would not fit without.
    model = enable_tree_attention(build(shape, device, smoke, checkpointing=True))
    model.train()
    flops, rng = flop_model(model), np.random.default_rng(3)
    results = []
    for workload in SPEED_WORKLOADS:
        results.append(
            {"shape": shape, **compare_packings(model, flops, rng, workload, smoke, peak, repeats)}
        )
        log(f"speed {results[-1]}")
    del model
    return results


def mfu_rows(device, smoke: bool, peak: float, repeats: int) -> list[dict]:
    """1.7B on rows of 8k-32k tokens, no activation checkpointing (it fits; recomputation is not
    model FLOPs)."""
    model = enable_tree_attention(build("1.7B", device, smoke))
    model.train()
    flops, rng = flop_model(model), np.random.default_rng(4)
    results = []
    for budget in (8192, 16384, 32768):
        results.append(mfu_row(model, flops, rng, budget, smoke, peak, repeats))
        log(f"mfu {results[-1]}")
    del model
    return results


def compiled(device, smoke: bool, peak: float, repeats: int) -> dict:
    """1.7B with compiled layers: MFU on 8k-32k rows (no checkpointing), and tree vs plain at
    packing ratios ~1 and ~3.4 (with checkpointing, as in the eager speed table)."""
    model = enable_tree_attention(build("1.7B", device, smoke))
    model.train()
    compile_decoder_layers(model)
    flops, rng = flop_model(model), np.random.default_rng(6)
    out = {"mfu": [], "speed": []}
    for budget in (8192, 16384, 32768):
        out["mfu"].append(mfu_row(model, flops, rng, budget, smoke, peak, repeats))
        log(f"compiled mfu {out['mfu'][-1]}")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for workload in (SPEED_WORKLOADS[0], SPEED_WORKLOADS[2]):
        out["speed"].append(compare_packings(model, flops, rng, workload, smoke, peak, repeats))
        log(f"compiled speed {out['speed'][-1]}")
    return out


def memory_sweep(device, smoke: bool, deadline: float) -> list[dict]:
    model = enable_tree_attention(build("1.7B", device, smoke, checkpointing=True))
    model.train()
    rng = np.random.default_rng(5)
    results = []
    budget = 8192
    while budget <= (1 << 20):
        completion = 1024 if not smoke else 8
        groups = max(1, budget // (512 + 8 * completion))
        samples = make_groups(rng, groups, 512 if not smoke else 8, completion, model.config.vocab_size)
        row = pack_row(samples)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            started = time.perf_counter()
            fwd_bwd(model, row)
            if device.type == "cuda":
                torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else 0.0
            results.append({"token_budget": budget, "row_tokens": row.num_tokens, "peak_memory_gb": peak,
                            "seconds": time.perf_counter() - started, "fits": True})  # fmt: skip
            log(f"memory {results[-1]}")
        except torch.OutOfMemoryError:
            results.append({"token_budget": budget, "row_tokens": row.num_tokens, "fits": False})
            log(f"memory {results[-1]}")
            break
        if (smoke and budget >= 32768) or time.perf_counter() > deadline:
            break
        budget *= 2
    del model
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, on CPU: checks the script runs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="peak,correct,speed,mfu,memory")
    args = parser.parse_args()
    require_cuda(args.smoke)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    parts = set(args.only.split(","))
    report: dict = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    log(f"{report}")
    started = time.perf_counter()
    report["matmul_peak_tflops"] = matmul_peak(device) / 1e12
    log(f"bf16 matmul peak {report['matmul_peak_tflops']:.1f} TFLOP/s")
    peak = report["matmul_peak_tflops"] * 1e12
    if "correct" in parts:
        report["flex_vs_dense_rel_err"] = check_flex_vs_dense(device)
        log(f"flex vs dense rel err {report['flex_vs_dense_rel_err']:.2e}")
        report["correctness"] = [check_correctness(shape, device, args.smoke) for shape in QWEN3]
        log(f"correctness {report['correctness']}")
    deadline = started + 540  # leave the output time to come back within the 10-minute call

    def time_left(phase: str) -> bool:
        if time.perf_counter() < deadline:
            return True
        log(f"skipping {phase}: out of time")
        return False

    if "speed" in parts and time_left("speed"):
        report["speed"] = [
            row for shape in QWEN3 for row in speed(shape, device, args.smoke, peak, args.repeats)
        ]
    if "mfu" in parts and time_left("mfu"):
        report["mfu"] = mfu_rows(device, args.smoke, peak, args.repeats)
    if "compiled" in parts and time_left("compiled"):
        report["compiled"] = compiled(device, args.smoke, peak, args.repeats)
    if "memory" in parts and time_left("memory"):
        report["memory"] = memory_sweep(device, args.smoke, deadline)
    report["seconds"] = time.perf_counter() - started
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_training.json").write_text(json.dumps(report, indent=1))
    print_table(report)


def print_table(report: dict) -> None:
    log(
        f"\n{report['device']} torch {report['torch']}: bf16 matmul peak {report['matmul_peak_tflops']:.0f} "
        "TFLOP/s"
    )
    for row in report.get("correctness", []):
        log(
            f"correct {row['shape']}: packed vs alone max|d|={row['max_abs_diff']:.3f} "
            f"mean|d|={row['mean_abs_diff']:.4f}"
        )
    if "flex_vs_dense_rel_err" in report:
        log(f"flex vs dense fp32 rel err {report['flex_vs_dense_rel_err']:.1e}")
    log("| model | ratio | tok/s packed | tok/s unpacked | speedup | ideal | MFU (tree) | peak mem GB |")
    log("|---|---|---|---|---|---|---|---|")
    for row in report.get("speed", []):
        log(
            f"| {row['shape']} | {row['ratio']:.2f} | {row['tree_tokens_per_s']:,.0f} | "
            f"{row['plain_tokens_per_s']:,.0f} | {row['speedup']:.2f} | {row['ratio']:.2f} | "
            f"{row['tree_mfu']:.1%} | {row['peak_memory_gb']:.1f} |"
        )
    for row in report.get("mfu", []):
        log(f"mfu 1.7B budget {row['token_budget']}: {row['tflops']:.0f} TFLOP/s = {row['mfu']:.1%} of peak")
    for row in report.get("memory", []):
        log(
            f"memory 1.7B ckpt budget {row['token_budget']}: "
            f"{row.get('peak_memory_gb', float('nan')):.1f} GB fits={row['fits']}"
        )
    for row in report.get("compiled", {}).get("mfu", []):
        log(
            f"compiled layers, mfu 1.7B budget {row['token_budget']}: {row['tflops']:.0f} TFLOP/s = "
            f"{row['mfu']:.1%}"
        )
    for row in report.get("compiled", {}).get("speed", []):
        log(
            f"compiled layers, ratio {row['ratio']:.2f}: speedup {row['speedup']:.2f} "
            f"(FLOP ratio {row['flop_ratio']:.2f})"
        )
    log(f"total {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
