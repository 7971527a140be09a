"""Part benchmark: the optimizer step alone (gradient norm + AdamW) over the Qwen3-1.7B shape's fp32
parameters on a GPU, torch's fused AdamW (what the trainer used) against the Triton update
(asyncgrpo.kernels.adamw_kernel), with the launch settings swept. A part of the step, not the step: the
step's figure is bench/gpu_step.py.

Traffic: the update reads parameter, gradient and both moments and writes back parameter and moments
(28 bytes a parameter); the norm reads the gradients (4 bytes a parameter). Also checks that five steps
of each from the same state agree.

Run (GPU machine): `python bench/adamw_step.py`. Prints `adamw_step torch_ms=X triton_ms=Y` last.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fused_head_passes import timed_ms  # noqa: E402
from gpu_training import QWEN3, QWEN3_COMMON, require_cuda  # noqa: E402

from asyncgrpo.trainer.optimizer_step import queue_clipped_step  # noqa: E402


def qwen3_shapes(shape: str) -> list[tuple[int, ...]]:
    """The parameter shapes of a Qwen3 model (tied embeddings), in the model's order."""
    c = dict(QWEN3_COMMON, **QWEN3[shape])
    hidden, mlp, dim = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * dim, c["num_key_value_heads"] * dim
    layer = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (dim,), (dim,),
             (mlp, hidden), (mlp, hidden), (hidden, mlp), (hidden,), (hidden,)]  # fmt: skip
    return [(c["vocab_size"], hidden), *layer * c["num_hidden_layers"], (hidden,)]


def parameters(shapes, seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    params = []
    for shape in shapes:
        param = torch.nn.Parameter(torch.randn(shape, device="cuda", generator=gen) * 0.02)
        param.grad = torch.randn(shape, device="cuda", generator=gen) * 1e-3
        params.append(param)
    return params


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1.7B", choices=sorted(QWEN3))
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    require_cuda(None)
    from asyncgrpo.kernels.adamw_kernel import BLOCK, WARPS, TritonAdamW, adamw_update_

    shapes = qwen3_shapes(args.shape)
    count = sum(torch.Size(s).numel() for s in shapes)
    print(f"{args.shape}: {len(shapes)} tensors, {count / 1e9:.3f} B parameters", flush=True)
    settings = dict(lr=1e-6, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-8)
    loss = torch.zeros((), device="cuda")

    def report(name: str, ms: float, bytes_per_param: int) -> None:
        print(f"{name}: {ms:.2f} ms, {bytes_per_param * count / ms / 1e9:.2f} TB/s", flush=True)

    # Agreement: five clipped steps of each from the same parameters and gradients, at a learning rate
    # large enough that the updates, not the parameters' own rounding, set the difference.
    reference, candidate = parameters(shapes, 0), parameters(shapes, 0)
    torch_adamw = torch.optim.AdamW(reference, fused=True, **{**settings, "lr": 1e-3})
    triton_adamw = TritonAdamW(candidate, **{**settings, "lr": 1e-3})
    for _ in range(5):
        queue_clipped_step(torch_adamw, reference, 1.0, loss)
        queue_clipped_step(triton_adamw, candidate, 1.0, loss)
    worst = max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(reference, candidate))
    print(f"5 clipped steps, Triton vs torch: largest difference {worst:.2e} of the tensor's largest value")
    moment = max(
        ((torch_adamw.state[a][key] - triton_adamw.state[b][key]).abs().max()
         / torch_adamw.state[a][key].abs().max()).item()
        for a, b in zip(reference, candidate) for key in ("exp_avg", "exp_avg_sq")
    )  # fmt: skip
    print(f"moments: largest difference {moment:.2e} of the tensor's largest value", flush=True)
    del candidate, triton_adamw

    grads = [p.grad for p in reference]
    report(
        "gradient norm (torch get_total_norm)",
        timed_ms(lambda: torch.nn.utils.get_total_norm(grads), args.repeats),
        4,
    )
    one, zero = torch.ones((), device="cuda"), torch.zeros((), device="cuda")
    torch_adamw.grad_scale, torch_adamw.found_inf = one, zero
    report("torch fused AdamW step", timed_ms(torch_adamw.step, args.repeats), 28)
    del torch_adamw.grad_scale, torch_adamw.found_inf
    torch_ms = timed_ms(lambda: queue_clipped_step(torch_adamw, reference, 1.0, loss), args.repeats)
    report("norm + torch fused AdamW (queue_clipped_step)", torch_ms, 32)

    state = [torch_adamw.state[p] for p in reference]
    exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in state], [s["exp_avg_sq"] for s in state]
    steps = [s["step"] for s in state]
    for block, warps in itertools.product((1024, 2048, 4096, 8192), (4, 8, 16)):

        def update():
            adamw_update_(reference, grads, exp_avgs, exp_avg_sqs, steps, lr=1e-6, beta1=0.9, beta2=0.99,
                          eps=1e-8, weight_decay=0.01, grad_scale=one, found_inf=zero,
                          block=block, warps=warps)  # fmt: skip

        report(f"Triton update, {block} elements x {warps} warps", timed_ms(update, args.repeats), 28)

    triton_adamw = TritonAdamW(reference, **settings)
    triton_adamw.load_state_dict(torch_adamw.state_dict())
    triton_ms = timed_ms(lambda: queue_clipped_step(triton_adamw, reference, 1.0, loss), args.repeats)
    report(f"norm + TritonAdamW (queue_clipped_step, {BLOCK} x {WARPS})", triton_ms, 32)
    print(f"adamw_step torch_ms={torch_ms:.2f} triton_ms={triton_ms:.2f}")


if __name__ == "__main__":
    main()
