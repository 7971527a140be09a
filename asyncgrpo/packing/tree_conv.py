"""The Gated DeltaNet layers' path convolution + SiLU as Triton kernels (CUDA only).

out[r] = silu(bias + sum_j weight[:, j] * x[conv_index[r, j]]), a missing predecessor (index P)
reading zero: each token's K-1 previous taps follow its trie path, not the row order
(`packing.gated_deltanet.tree_causal_conv1d` is the definition and the CPU reference).

Forward: one pass, fp32 inside, the output in x's dtype. Backward: one pass that recomputes the
pre-activation, writes d pre-activation (fp32) and per-block partial sums of the weight's and bias's
gradients (summed by torch afterwards: deterministic, no atomics), then one pass that gives each token
its gradient from the rows that read it (`conv_successors`: a token at a branch point is read by
every child segment's first rows), again without atomics. Tested on CPU through Triton's interpreter
(tests/tree_conv_check.py), compiled for sm_90 on CPU (tests/tree_conv_compile_check.py), and on the
GPU by tests/test_gated_deltanet_gpu.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows x channels per program: a 32 x 128 fp32 tile (4,096 values, 16 per thread at 4 warps) keeps one
# program's registers small while each tap's load reads 128 contiguous channels of a row. A first
# choice, not tuned on a GPU yet.
BLOCK_ROWS, BLOCK_CHANNELS = 32, 128


@triton.jit
def _pre_activation(x_ptr, w_ptr, b_ptr, index_ptr, rows, cols, row_ok, col_ok, num_rows, x_stride,
                    HAS_BIAS: tl.constexpr, K: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr):  # fmt: skip
    acc = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    for j in tl.static_range(K):
        src = tl.load(index_ptr + rows * K + j, mask=row_ok, other=num_rows)
        ok = (src < num_rows)[:, None] & col_ok[None, :]
        tap = tl.load(x_ptr + src.to(tl.int64)[:, None] * x_stride + cols[None, :], mask=ok, other=0.0)
        w = tl.load(w_ptr + cols * K + j, mask=col_ok, other=0.0).to(tl.float32)
        acc += tap.to(tl.float32) * w[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _forward_kernel(x_ptr, w_ptr, b_ptr, index_ptr, out_ptr, num_rows, channels, x_stride,
                    HAS_BIAS: tl.constexpr, K: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok, col_ok = rows < num_rows, cols < channels
    pre = _pre_activation(x_ptr, w_ptr, b_ptr, index_ptr, rows, cols, row_ok, col_ok, num_rows, x_stride,
                          HAS_BIAS, K, BLOCK_R, BLOCK_C)  # fmt: skip
    out = pre * tl.sigmoid(pre)
    mask = row_ok[:, None] & col_ok[None, :]
    offsets = rows.to(tl.int64)[:, None] * channels + cols[None, :]
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_rows_kernel(x_ptr, w_ptr, b_ptr, index_ptr, grad_out_ptr, grad_pre_ptr, partial_w_ptr,
                          partial_b_ptr, num_rows, channels, x_stride,
                          HAS_BIAS: tl.constexpr, K: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr):  # fmt: skip
    """d pre-activation of each row, and this block's share of d weight (K, C) and d bias (C,)."""
    block = tl.program_id(0)
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok, col_ok = rows < num_rows, cols < channels
    mask = row_ok[:, None] & col_ok[None, :]
    pre = _pre_activation(x_ptr, w_ptr, b_ptr, index_ptr, rows, cols, row_ok, col_ok, num_rows, x_stride,
                          HAS_BIAS, K, BLOCK_R, BLOCK_C)  # fmt: skip
    offsets = rows.to(tl.int64)[:, None] * channels + cols[None, :]
    grad_out = tl.load(grad_out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(pre)
    grad_pre = grad_out * sig * (1.0 + pre * (1.0 - sig))  # silu'(p) = s (1 + p (1 - s))
    tl.store(grad_pre_ptr + offsets, grad_pre, mask=mask)
    if HAS_BIAS:
        tl.store(partial_b_ptr + block * channels + cols, tl.sum(grad_pre, axis=0), mask=col_ok)
    for j in tl.static_range(K):
        src = tl.load(index_ptr + rows * K + j, mask=row_ok, other=num_rows)
        ok = (src < num_rows)[:, None] & col_ok[None, :]
        tap = tl.load(x_ptr + src.to(tl.int64)[:, None] * x_stride + cols[None, :], mask=ok, other=0.0)
        partial = tl.sum(grad_pre * tap.to(tl.float32), axis=0)
        tl.store(partial_w_ptr + (block * K + j) * channels + cols, partial, mask=col_ok)


@triton.jit
def _backward_tokens_kernel(w_ptr, grad_pre_ptr, offsets_ptr, successors_ptr, grad_x_ptr, num_rows,
                            channels, K: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_C: tl.constexpr):  # fmt: skip
    """d x[t] = sum over the (row r, tap j) that read token t of weight[:, j] * d pre[r]."""
    tokens = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    token_ok, col_ok = tokens < num_rows, cols < channels
    # Every per-token value as a (BLOCK_R, BLOCK_C) tile (the same value along a row): Triton 3.6's
    # layout pass fails to compile this loop when its per-token masks are 1-D (seen on an H200).
    tile_tokens = tokens[:, None] + tl.zeros((BLOCK_R, BLOCK_C), tl.int32)
    tile_ok = token_ok[:, None] & col_ok[None, :]
    first = tl.load(offsets_ptr + tile_tokens, mask=tile_ok, other=0)
    count = tl.load(offsets_ptr + tile_tokens + 1, mask=tile_ok, other=0) - first
    acc = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    for e in range(0, tl.max(tl.max(count, axis=1), axis=0)):
        ok = e < count
        entry = tl.load(successors_ptr + first + e, mask=ok, other=0)
        row, tap = entry // K, entry % K
        w = tl.load(w_ptr + cols[None, :] * K + tap, mask=ok, other=0.0).to(tl.float32)
        grad_pre = tl.load(grad_pre_ptr + row.to(tl.int64) * channels + cols[None, :], mask=ok, other=0.0)
        acc += w * grad_pre
    mask = token_ok[:, None] & col_ok[None, :]
    offsets = tokens.to(tl.int64)[:, None] * channels + cols[None, :]
    tl.store(grad_x_ptr + offsets, acc.to(grad_x_ptr.dtype.element_ty), mask=mask)


def _grid(num_rows: int, channels: int) -> tuple[int, int]:
    return triton.cdiv(num_rows, BLOCK_ROWS), triton.cdiv(channels, BLOCK_CHANNELS)


def _rows_with_unit_stride(x: torch.Tensor) -> torch.Tensor:
    """x itself when its channels are contiguous (a column slice of a wider matmul output is), else a
    contiguous copy: the kernels read rows through their stride."""
    return x if x.stride(1) == 1 else x.contiguous()


class TreeConvSilu(torch.autograd.Function):
    """silu(path convolution) of x (P, C) -> (P, C) in x's dtype; weight (C, K), bias (C,) or None;
    conv_index (P, K), successor_offsets (P + 1,), successors (E,): the layout's tensors."""

    @staticmethod
    def forward(ctx, x, weight, bias, conv_index, successor_offsets, successors):
        x, weight = _rows_with_unit_stride(x), weight.contiguous()
        num_rows, channels = x.shape
        out = torch.empty(num_rows, channels, dtype=x.dtype, device=x.device)
        _forward_kernel[_grid(num_rows, channels)](
            x, weight, weight if bias is None else bias, conv_index, out, num_rows, channels, x.stride(0),
            HAS_BIAS=bias is not None, K=weight.shape[1], BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_CHANNELS,
        )  # fmt: skip
        ctx.save_for_backward(x, weight, bias, conv_index, successor_offsets, successors)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, conv_index, successor_offsets, successors = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        num_rows, channels = x.shape
        kernel_size = weight.shape[1]
        grid = _grid(num_rows, channels)
        grad_pre = torch.empty(num_rows, channels, dtype=torch.float32, device=x.device)
        partial_w = torch.empty(grid[0], kernel_size, channels, dtype=torch.float32, device=x.device)
        partial_b = torch.empty(grid[0], channels, dtype=torch.float32, device=x.device)
        _backward_rows_kernel[grid](
            x, weight, weight if bias is None else bias, conv_index, grad_out, grad_pre, partial_w, partial_b,
            num_rows, channels, x.stride(0),
            HAS_BIAS=bias is not None, K=kernel_size, BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_CHANNELS,
        )  # fmt: skip
        grad_x = torch.empty(num_rows, channels, dtype=x.dtype, device=x.device)
        _backward_tokens_kernel[grid](
            weight, grad_pre, successor_offsets, successors, grad_x, num_rows, channels,
            K=kernel_size, BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_CHANNELS,
        )  # fmt: skip
        grad_w = partial_w.sum(0).T.to(weight.dtype)
        grad_b = None if bias is None else partial_b.sum(0).to(bias.dtype)
        return grad_x, grad_w, grad_b, None, None, None


def tree_conv_silu(x, weight, bias, layout) -> torch.Tensor:
    """silu(path convolution) of x (P, C) in the layer order of `layout` (a `RecurrentLayout`)."""
    return TreeConvSilu.apply(
        x, weight, bias, layout.conv_index, layout.conv_successor_offsets, layout.conv_successors
    )
