"""The fused gated RMS norm (`asyncgrpo.packing.gated_norm`) against its definition in fp64, values
and gradients. Used by tests/unit/test_gated_deltanet.py on CPU through Triton's interpreter, where this
file runs as a script in a process of its own with TRITON_INTERPRET=1 (Triton reads it when the
kernels are defined); the GPU test (tests/gpu/test_gated_deltanet_gpu.py) runs the compiled kernels at
the Qwen3.5-2B shape. The gate is read through its strides, as the layer passes a column slice of
its projections' output.
"""

from __future__ import annotations

EPS = 1e-6
# (tokens, heads, head dim): the models' 128 (a whole block) with a row count no multiple of the
# kernels' rows, and a dim that is no power of two (a masked block).
GATED_NORM_CASES = ((37, 3, 128), (9, 2, 48))


def gated_norm_definition(x, z, weight, eps: float):
    """weight * x / rms(x) * silu(z) over the last dim, in the inputs' dtype."""
    import torch

    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (z * torch.sigmoid(z))


def check_case(shape: tuple[int, int, int], dtype, device: str = "cpu") -> list[float]:
    """fp32: within fp32 round-off of fp64; bf16 inputs (fp32 weight, as under autocast): within the
    rounding of the bf16 outputs. Returns the relative errors of out, d x, d z, d weight."""
    import torch

    from asyncgrpo.packing.gated_norm import gated_rms_norm

    tokens, heads, dim = shape
    gen = torch.Generator(device=device).manual_seed(11)
    x = torch.randn(tokens, heads, dim, generator=gen, device=device).to(dtype)
    wide = torch.randn(tokens, heads * dim + 7, generator=gen, device=device).to(dtype)
    z = wide[:, 3 : 3 + heads * dim].view(tokens, heads, dim)  # strided, like the layer's gate
    weight = 1 + torch.randn(dim, generator=gen, device=device) / 4
    cotangent = torch.randn(tokens, heads, dim, generator=gen, device=device, dtype=torch.float64)
    exact = [t.double().requires_grad_() for t in (x, z, weight)]
    want = gated_norm_definition(*exact, EPS)
    want_grads = torch.autograd.grad((want * cotangent).sum(), exact)
    leaves = [t.detach().clone().requires_grad_() for t in (x, wide, weight)]
    gate = leaves[1][:, 3 : 3 + heads * dim].view(tokens, heads, dim)
    got = gated_rms_norm(leaves[0], gate, leaves[2], EPS)
    got_grads = list(torch.autograd.grad((got.double() * cotangent).sum(), leaves))
    assert got.dtype == dtype and got.shape == want.shape
    assert [g.dtype for g in got_grads] == [leaf.dtype for leaf in leaves]
    assert got_grads[1][:, :3].abs().max() == 0 and got_grads[1][:, 3 + heads * dim :].abs().max() == 0
    got_grads[1] = got_grads[1][:, 3 : 3 + heads * dim].view(tokens, heads, dim)
    errors = []
    for label, value, expected in zip(
        ("out", "d x", "d z", "d weight"), (got, *got_grads), (want, *want_grads)
    ):
        expected = expected.detach()
        error = float((value.detach().double() - expected).norm() / expected.norm())
        errors.append(error)
        bound = 1e-5 if dtype == torch.float32 else 1e-2  # bf16 rounds each element by up to 2^-9
        assert error <= bound, (label, error)
    return errors


if __name__ == "__main__":  # on CPU, under TRITON_INTERPRET=1
    import torch

    for shape in GATED_NORM_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            check_case(shape, dtype)
            print(f"ok {shape} {dtype}", flush=True)
