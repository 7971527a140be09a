"""The gated RMS norm after a Gated DeltaNet layer's recurrence, as Triton kernels (CUDA only).

out = weight * x / rms(x) * silu(z), per token and head over the head's D values: x the recurrence's
output (P, H, D), z the gate projection (P, H, D). The models' own module (Qwen3.5's, Qwen3-Next's
`...RMSNormGated`) runs it as a dozen eager kernels forward and more backward, each over an fp32 copy
of the (P, H x D) activations; here forward is one pass (x and z read once, out written once) and
backward one more (x, z and d out read once, d x and d z written once, per-program partial sums of
d weight added up by torch), fp32 inside, outputs in the inputs' dtypes. The module's own rounding of
the normalized value to x's dtype before the weight is not reproduced: this computes the function in
fp32 throughout (the tests hold it to the function in fp64, tests/support/gated_norm_check.py).

Tested on CPU through Triton's interpreter (tests/support/gated_norm_check.py), compiled for sm_90 on CPU
(tests/support/tree_conv_compile_check.py), and on the GPU by tests/gpu/test_gated_deltanet_gpu.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (token, head) rows per program and warps, forward and backward: 32 rows of a 128-value head, 32
# values per thread per tensor forward (64 registers) and 16 backward (8 warps: 76 registers, where 4
# warps took 194 and fewer programs fit on a multiprocessor). Compiled for sm_90 on CPU
# (tests/support/tree_conv_compile_check.py prints the registers); bench/gdn_kernels.py times others on a GPU.
BLOCK_ROWS = 32
FORWARD_WARPS, BACKWARD_WARPS = 4, 8


@triton.jit
def _load_rows(x_ptr, z_ptr, w_ptr, rows, num_rows, heads, z_stride_token, z_stride_head, D: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """x, z (fp32) and the weight of `rows` (token * heads + head); their mask and x's offsets."""
    dims = tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (dims < D)[None, :]
    token, head = rows // heads, rows % heads
    x_offsets = rows.to(tl.int64)[:, None] * D + dims[None, :]
    z_offsets = token.to(tl.int64)[:, None] * z_stride_token + head[:, None] * z_stride_head + dims[None, :]
    x = tl.load(x_ptr + x_offsets, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + z_offsets, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + dims, mask=dims < D, other=0.0).to(tl.float32)
    return x, z, w, mask, x_offsets


@triton.jit
def _forward_kernel(x_ptr, z_ptr, w_ptr, out_ptr, num_rows, heads, z_stride_token, z_stride_head, eps,
                    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    x, z, w, mask, offsets = _load_rows(x_ptr, z_ptr, w_ptr, rows, num_rows, heads, z_stride_token,
                                        z_stride_head, D, BLOCK_R, BLOCK_D)  # fmt: skip
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    out = x * rstd[:, None] * w[None, :] * (z * tl.sigmoid(z))
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(x_ptr, z_ptr, w_ptr, grad_out_ptr, grad_x_ptr, grad_z_ptr, partial_w_ptr, num_rows,
                     heads, z_stride_token, z_stride_head, eps, D: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_D: tl.constexpr):  # fmt: skip
    """With n = x rstd and a = d out * w * silu(z) (d loss / d n): d x = rstd (a - n mean(a n)),
    d z = d out * w * n * silu'(z), d weight = sum over rows of d out * n * silu(z)."""
    block = tl.program_id(0)
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    x, z, w, mask, offsets = _load_rows(x_ptr, z_ptr, w_ptr, rows, num_rows, heads, z_stride_token,
                                        z_stride_head, D, BLOCK_R, BLOCK_D)  # fmt: skip
    grad_out = tl.load(grad_out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    normed = x * rstd[:, None]
    sig = tl.sigmoid(z)
    gate = z * sig
    grad_normed = grad_out * w[None, :] * gate
    mean = tl.sum(grad_normed * normed, axis=1) / D
    grad_x = rstd[:, None] * (grad_normed - normed * mean[:, None])
    grad_z = grad_out * w[None, :] * normed * sig * (1.0 + z * (1.0 - sig))
    tl.store(grad_x_ptr + offsets, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_z_ptr + offsets, grad_z.to(grad_z_ptr.dtype.element_ty), mask=mask)
    dims = tl.arange(0, BLOCK_D)
    tl.store(partial_w_ptr + block * D + dims, tl.sum(grad_out * normed * gate, axis=0), mask=dims < D)


def _launch_args(x: torch.Tensor, z: torch.Tensor, warps: int) -> tuple[tuple, dict, int]:
    tokens, heads, dim = x.shape
    num_rows = tokens * heads
    blocks = triton.cdiv(num_rows, BLOCK_ROWS)
    sizes = (num_rows, heads, z.stride(0), z.stride(1))
    constants = {"D": dim, "BLOCK_R": BLOCK_ROWS, "BLOCK_D": triton.next_power_of_2(dim), "num_warps": warps}
    return sizes, constants, blocks


class GatedRMSNorm(torch.autograd.Function):
    """weight * x / rms(x) * silu(z) over the last dim: x (P, H, D), z (P, H, D) (any strides with the
    last dim contiguous), weight (D,) -> (P, H, D) in x's dtype."""

    @staticmethod
    def forward(ctx, x, z, weight, eps: float):
        x = x.contiguous()
        z = z if z.stride(-1) == 1 else z.contiguous()
        if z.shape != x.shape or weight.shape != x.shape[-1:]:
            raise ValueError(
                f"gated norm: x {tuple(x.shape)}, z {tuple(z.shape)}, weight {tuple(weight.shape)}"
            )
        out = torch.empty_like(x)
        sizes, constants, blocks = _launch_args(x, z, FORWARD_WARPS)
        _forward_kernel[(blocks,)](x, z, weight, out, *sizes, eps, **constants)
        ctx.save_for_backward(x, z, weight)
        ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, z, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x, grad_z = torch.empty_like(x), torch.empty(x.shape, dtype=z.dtype, device=x.device)
        sizes, constants, blocks = _launch_args(x, z, BACKWARD_WARPS)
        partial_w = torch.empty(blocks, x.shape[-1], dtype=torch.float32, device=x.device)
        _backward_kernel[(blocks,)](x, z, weight, grad_out, grad_x, grad_z, partial_w, *sizes, ctx.eps,
                                    **constants)  # fmt: skip
        return grad_x, grad_z, partial_w.sum(0).to(weight.dtype), None


def gated_rms_norm(x, z, weight, eps: float) -> torch.Tensor:
    """The fused gated RMS norm (see the module doc): x, z (P, H, D), weight (D,) -> (P, H, D)."""
    return GatedRMSNorm.apply(x, z, weight, eps)
