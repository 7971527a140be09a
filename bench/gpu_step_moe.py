"""The whole optimizer step for a Qwen3-30B-A3B-shaped MoE model on one GPU (issue 59).

The same step as bench/gpu_step.py: `AsyncGRPOTrainer` built with its defaults around random fp32
weights of Qwen/Qwen3-30B-A3B's public config (128 experts of 2048 x 768, 8 a token, 32 query and 4
key/value heads of 128), with as many decoder layers as the defaults fit on the card
(`layers_that_fit`; `--layers` to choose), prepared as `train()` does (compiled layers, checkpoint
only to fit, fused head, bf16 autocast, tree packing, the router's load-balancing loss at the
config's 0.001, no routing replay), then `_forward_backward` and `_optimizer_step` on 2 micro-batches
of one DeepMath-like row each; no vLLM server, only the samples are synthetic.
MFU counts the active parameters (the 8 routed experts and the router of each token, attention, the
head on trained tokens: asyncgrpo.modeling.perf), against the card's bf16 matmul peak measured in the call.

Variants, in this order, on the same model (`--variants`):
  - `transformers`: the experts as transformers runs them for these fp32 weights in compiled layers
    (its "grouped_mm" implementation falls back to a loop of fp32 matmuls, expert after expert);
  - `asyncgrpo-grouped`: the trainer's default, `asyncgrpo.kernels.moe_experts` (the sorted pairs
    through two bf16 grouped GEMMs).
Each prints its step time, MFU and a profile by kernel family.

Run (GPU machine): `python bench/gpu_step_moe.py --out $OUT`; `--smoke` runs tiny shapes on CPU.
The last line is `gpu_step_moe mfu=Z target=0.45` (the trainer's default experts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from gpu_step import deepmath_plans, log, make_trainer, plan_flops, profile, timed_steps  # noqa: E402
from gpu_training import matmul_peak, require_cuda  # noqa: E402

from asyncgrpo.kernels.moe_experts import GROUPED_EXPERTS  # noqa: E402
from asyncgrpo.modeling.perf import flop_model  # noqa: E402

TARGET_MFU = 0.45  # issue 59: the default step's MFU on the active parameters
QWEN3_30B_A3B = dict(
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
    num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
    rope_theta=1_000_000, rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False,
    norm_topk_prob=True, router_aux_loss_coef=0.001, decoder_sparse_step=1, mlp_only_layers=[],
    num_hidden_layers=48,
)  # fmt: skip
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                   num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   vocab_size=1024)  # fmt: skip
# name -> the experts implementation the variant's steps run (None: what the trainer chose)
VARIANTS = {"transformers": "grouped_mm", "asyncgrpo-grouped": GROUPED_EXPERTS}
GIB = 1 << 30


def layer_bytes(shape: dict) -> tuple[float, float]:
    """(bytes a decoder layer holds across steps, bytes one layer of a 16k-token row needs while it
    runs). Held: fp32 weights, gradients and AdamW's two moments (16 bytes a parameter). Running, no
    layer checkpointed: the bf16 weight copies (autocast's casts, kept for backward) and the
    activations of 16k tokens x 8 experts (~12.5 KB a token-expert pair in bf16) plus attention's."""
    h, i, e = shape["hidden_size"], shape["moe_intermediate_size"], shape["num_experts"]
    heads, kv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    params = 3 * e * h * i + e * h + h * d * (2 * heads + 2 * kv)
    pairs = 16384 * shape["num_experts_per_tok"]
    return 16.0 * params, 2.0 * params + pairs * (4 * h + 6 * i) + 16384 * 24 * h


def layers_that_fit(shape: dict, card_bytes: float) -> int:
    """Decoder layers whose held and running bytes, with the embeddings and head (16 bytes a parameter
    each, untied) and 8 GiB of head logits and workspaces, fit 90% of the card."""
    held, running = layer_bytes(shape)
    fixed = 16.0 * 2 * shape["vocab_size"] * shape["hidden_size"] + 8 * GIB
    return max(1, int((0.9 * card_bytes - fixed) // (held + running)))


def build_model(layers: int, smoke: bool, device: torch.device) -> Qwen3MoeForCausalLM:
    values = dict(QWEN3_30B_A3B, num_hidden_layers=layers, **(SMOKE_SHAPE if smoke else {}))
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**values, dtype="float32"))  # fp32: the trainer's default


def measure(name: str, model, trainer, plans, flops, peak: float, args) -> dict:
    model.set_experts_implementation(VARIANTS[name])
    rows = [row for plan in plans for row in plan.pack()]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    seconds = timed_steps(trainer, plans, args.repeats, args.warmup, name)
    result = {
        "variant": name, "experts": model.config._experts_implementation, "seconds": seconds,
        "mfu": plan_flops(flops, rows) / seconds / peak, "row_tokens": [r.num_tokens for r in rows],
        "wall_s": time.perf_counter() - started,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else 0.0,
        "checkpointed_layers": trainer._run.metrics.window.summarize().get("perf/checkpointed_layers"),
    }  # fmt: skip
    log(f"variant {json.dumps(result)}")
    result["profile"] = profile(trainer, plans, f"{name} step")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, on CPU: checks the script runs")
    parser.add_argument("--budget", type=int, default=16384, help="token_budget of each of the 2 rows")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (0: as many as fit the card)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated: {', '.join(VARIANTS)}"
    )
    args = parser.parse_args()
    require_cuda(args.smoke)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.budget = min(args.budget, 2048)
    card = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    layers = args.layers or (2 if args.smoke else layers_that_fit(QWEN3_30B_A3B, card))
    report: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if card else "cpu",
                    "card_gb": card / 1e9, "layers": layers, "budget": args.budget}  # fmt: skip
    report["matmul_peak_tflops"] = matmul_peak(device) / 1e12
    log(f"{report}")
    model = build_model(layers, args.smoke, device)
    trainer = make_trainer({}, args.smoke, tempfile.mkdtemp(prefix="gpu_step_moe-"), model)
    report["trainer_experts"] = model.config._experts_implementation
    flops = flop_model(trainer._model)
    plans = deepmath_plans(np.random.default_rng(7), args.budget, 2, model.config.vocab_size, args.smoke)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report["variants"] = []
    for name in [n for n in args.variants.split(",") if n]:
        try:
            report["variants"].append(
                measure(name, model, trainer, plans, flops, report["matmul_peak_tflops"] * 1e12, args)
            )
        except torch.OutOfMemoryError as error:
            log(f"variant {name}: out of memory ({str(error)[:200]})")
            report["variants"].append({"variant": name, "out_of_memory": True})
            trainer._model.zero_grad(set_to_none=True)
        (out / "gpu_step_moe.json").write_text(json.dumps(report, indent=1, default=str))
    print_table(report)


def print_table(report: dict) -> None:
    log(f"\n{report['device']} torch {report['torch']}: Qwen3-30B-A3B shape, {report['layers']} layers, "
        f"2 rows of {report['budget']} tokens, bf16 matmul peak {report['matmul_peak_tflops']:.0f} TFLOP/s, "
        f"the trainer chose experts={report['trainer_experts']}")  # fmt: skip
    log("| variant | experts | step s | MFU (active params) | peak GB | ckpt layers |")
    log("|---|---|---|---|---|---|")
    for v in report["variants"]:
        if v.get("out_of_memory"):
            log(f"| {v['variant']} | out of memory | | | | |")
            continue
        log(f"| {v['variant']} | {v['experts']} | {v['seconds']:.3f} | {v['mfu']:.1%} | "
            f"{v['peak_memory_gb']:.1f} | {v['checkpointed_layers']} |")  # fmt: skip
    for v in report["variants"]:
        if not v.get("out_of_memory"):
            log(f"gpu_step_moe variant={v['variant']} mfu={v['mfu']:.3f}")
    default = [v for v in report["variants"] if v["variant"] == "asyncgrpo-grouped" and "mfu" in v]
    if default:
        log(f"gpu_step_moe mfu={default[0]['mfu']:.3f} target={TARGET_MFU}")


if __name__ == "__main__":
    main()
