"""Part benchmark: a Gated DeltaNet layer's path convolution and gated norm, forward and backward, on a GPU.

One row of the Qwen3.5-2B default step (DeepMath-like groups planned by the trainer's planner into
~16k tokens, its `RecurrentLayout`), the layer's tensors at their shapes: the convolution's input a
column slice of the projections' (P, 8224) bf16 output, 6,144 channels, fp32 weights (autocast keeps
them); the norm's (P, 16, 128) bf16 core and gate. For each kernel: forward, and forward + backward,
median times (`triton.testing.do_bench`), and the bandwidth of the bytes an ideal pass must move
(convolution forward: x read, out written, 4 bytes an element in bf16; backward: x and d out read,
d x written, 6; norm forward: x, z read, out written, 6; backward: x, z, d out read, d x, d z
written, 10), against a device-to-device copy measured in the same run. The convolutions compared:
asyncgrpo's Triton kernel at a few tiles, fla-core's varlen `causal_conv1d` (as the layer runs it,
the segments' initial states included) when installed; the norms: the fused kernel against the
model's module. The step's own figure is bench/gpu_step_qwen3_5.py; this one says where a layer's
time goes and picks the kernels' tiles. A part of the step, not the step.

Run (GPU machine): `python bench/gdn_kernels.py`; the last line is
`gdn_kernels conv_bwd_ms=X fla_conv_bwd_ms=Y norm_bwd_ms=Z model_norm_bwd_ms=W` (forward + backward
minus forward, at the modules' own settings).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_step import deepmath_plans  # noqa: E402
from gpu_training import QWEN3_5_2B, require_cuda  # noqa: E402

from asyncgrpo.packing import kernel_choice  # noqa: E402
from asyncgrpo.packing.path_conv import path_conv_and_activate  # noqa: E402
from asyncgrpo.packing.recurrent_layout import recurrent_layout  # noqa: E402

KERNEL_SIZE = 4
# Tiles (rows, channels, warps) of asyncgrpo's convolution kernels tried besides the module's own.
BACKWARD_TILES = [(32, 128, 4), (64, 128, 8), (64, 64, 4), (32, 64, 2), (64, 128, 16)]
FORWARD_TILES = [(32, 128, 4), (64, 128, 8), (16, 128, 2)]


def bench_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GB device-to-device copy (the ceiling used below)."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms * 1e3


def row_layout(budget: int):
    """The layout of one DeepMath-like row of ~`budget` tokens, as the trainer packs it."""
    plans = deepmath_plans(np.random.default_rng(7), budget, 1, QWEN3_5_2B["vocab_size"], smoke=False)
    row = plans[0].pack()[0]
    return recurrent_layout(np.asarray(row.segment_ids), np.asarray(row.subtree_end), KERNEL_SIZE, "cuda")


def fwd_bwd_ms(forward, inputs, grads) -> tuple[float, float]:
    """(forward ms, forward + backward ms) of `forward(*inputs)` -> tensors, with `grads` as their
    output gradients."""

    def forward_only():
        with torch.no_grad():
            forward(*inputs)

    def both():
        outs = forward(*inputs)
        torch.autograd.backward(outs, grads)

    return bench_ms(forward_only), bench_ms(both)


def conv_case(choice: str, layout, mixed, weight, widths):
    """Forward of the layer's path convolution with `choice` (ASYNCGRPO_PATH_CONV)."""

    def forward(x, w):
        os.environ[kernel_choice.PATH_CONV_ENV] = choice
        with torch.autocast(x.device.type, dtype=torch.bfloat16):  # as the layer runs: fp32 weight, bf16 x
            return path_conv_and_activate(x, w, None, layout, "silu", widths)

    return forward


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=int, default=16384, help="tokens of the row")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    require_cuda(smoke=None)
    from asyncgrpo.packing import gated_norm, tree_conv  # Triton: after the check

    report: dict = {"device": torch.cuda.get_device_name()}
    bandwidth = copy_bandwidth()
    report["copy_tb_s"] = bandwidth / 1e12
    print(
        f"{report['device']}: device-to-device copy {bandwidth / 1e12:.2f} TB/s (read + written)", flush=True
    )
    layout = row_layout(args.budget)
    tokens = layout.num_tokens
    key_dim = QWEN3_5_2B["linear_num_key_heads"] * QWEN3_5_2B["linear_key_head_dim"]
    heads, head_dim = QWEN3_5_2B["linear_num_value_heads"], QWEN3_5_2B["linear_value_head_dim"]
    widths = (key_dim, key_dim, heads * head_dim)
    channels = sum(widths)
    projected = 2 * channels + 2 * heads  # q|k|v, z, b, a: the layers' one projection matmul
    gen = torch.Generator(device="cuda").manual_seed(0)
    out_all = torch.randn(tokens, projected, device="cuda", generator=gen).bfloat16()
    projections = out_all.requires_grad_()
    mixed = projections[:, :channels]  # a column slice, as the layer's
    weight = (torch.randn(channels, KERNEL_SIZE, device="cuda", generator=gen) / 2).requires_grad_()
    conv_grads = [torch.randn(tokens, w, device="cuda", generator=gen).bfloat16() for w in widths]
    elements = tokens * channels
    report.update(tokens=tokens, channels=channels, segments=len(layout.segment_cu_seqlens) - 1,
                  remote_reads=len(layout.conv_remote_entries), levels=len(layout.levels))  # fmt: skip
    print(f"row: {tokens} tokens, {report['segments']} segments in {report['levels']} levels, "
          f"{report['remote_reads']} remote reads; {channels} channels", flush=True)  # fmt: skip

    def line(label: str, fwd_ms: float, both_ms: float, fwd_bytes: int, bwd_bytes: int) -> dict:
        bwd_ms = both_ms - fwd_ms
        entry = {"label": label, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "fwd_tb_s": fwd_bytes / fwd_ms / 1e9,
                 "bwd_tb_s": bwd_bytes / bwd_ms / 1e9}  # fmt: skip
        print(f"{label:<44} fwd {fwd_ms:6.3f} ms ({entry['fwd_tb_s']:.2f} TB/s)  bwd {bwd_ms:6.3f} ms "
              f"({entry['bwd_tb_s']:.2f} TB/s of the ideal bytes)", flush=True)  # fmt: skip
        return entry

    conv_bytes = (4 * elements, 6 * elements)
    report["conv"] = []
    defaults = (tree_conv.FORWARD_TILE, tree_conv.BACKWARD_TILE)
    for fwd_tile, bwd_tile in (
        [(None, None)] + [(None, t) for t in BACKWARD_TILES] + [(t, None) for t in FORWARD_TILES]
    ):
        tree_conv.FORWARD_TILE = tree_conv.Tile(*fwd_tile) if fwd_tile else defaults[0]
        tree_conv.BACKWARD_TILE = tree_conv.Tile(*bwd_tile) if bwd_tile else defaults[1]
        label = f"asyncgrpo conv fwd {tree_conv.FORWARD_TILE} bwd {tree_conv.BACKWARD_TILE}"
        try:
            timing = fwd_bwd_ms(
                conv_case("triton", layout, mixed, weight, widths), (mixed, weight), conv_grads
            )
            report["conv"].append(line(label, *timing, *conv_bytes))
        except Exception as error:  # noqa: BLE001  (a tile that does not build: the others still run)
            print(f"{label}: failed {error!r}"[:300], flush=True)
    tree_conv.FORWARD_TILE, tree_conv.BACKWARD_TILE = defaults
    if kernel_choice.installed("fla"):
        timing = fwd_bwd_ms(conv_case("fla", layout, mixed, weight, widths), (mixed, weight), conv_grads)
        report["fla_conv"] = line("fla causal_conv1d (+ initial states)", *timing, *conv_bytes)
    os.environ.pop(kernel_choice.PATH_CONV_ENV, None)

    core = torch.randn(tokens, heads, head_dim, device="cuda", generator=gen).bfloat16().requires_grad_()
    gate = projections[:, channels : channels + heads * head_dim].view(tokens, heads, head_dim)
    norm_weight = (1 + torch.randn(head_dim, device="cuda", generator=gen) / 4).requires_grad_()
    norm_grad = torch.randn(tokens, heads, head_dim, device="cuda", generator=gen).bfloat16()
    norm_elements = tokens * heads * head_dim
    norm_bytes = (6 * norm_elements, 10 * norm_elements)
    report["norm"] = line("asyncgrpo gated norm",
                          *fwd_bwd_ms(lambda x, z, w: gated_norm.gated_rms_norm(x, z, w, 1e-6),
                                      (core, gate, norm_weight), norm_grad), *norm_bytes)  # fmt: skip
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    module = Qwen3_5RMSNormGated(head_dim, eps=1e-6).cuda()

    def model_norm(x, z, w):  # w is the module's own weight
        return module(x.reshape(-1, head_dim), z.reshape(-1, head_dim)).view(tokens, heads, head_dim)

    timing = fwd_bwd_ms(model_norm, (core, gate, module.weight), norm_grad)
    report["model_norm"] = line("model's Qwen3_5RMSNormGated (eager)", *timing, *norm_bytes)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gdn_kernels.json").write_text(json.dumps(report, indent=1, default=str))
    fla = report.get("fla_conv", {}).get("bwd_ms", float("nan"))
    print(
        f"gdn_kernels conv_bwd_ms={report['conv'][0]['bwd_ms']:.3f} fla_conv_bwd_ms={fla:.3f} "
        f"norm_bwd_ms={report['norm']['bwd_ms']:.3f} model_norm_bwd_ms={report['model_norm']['bwd_ms']:.3f}"
    )


if __name__ == "__main__":
    main()
