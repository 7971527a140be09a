"""The Gated DeltaNet layers' path convolution + SiLU as Triton kernels (CUDA only).

out[r] = silu(bias + sum_j weight[:, j] * x[conv_index[r, j]]), a missing predecessor (index P)
reading zero: each token's K-1 previous taps follow its trie path, not the row order
(`packing.path_conv.tree_causal_conv1d` is the definition and the CPU reference).

Forward: one pass, fp32 inside, written in x's dtype, straight into the layer's q, k and v tensors
(`widths`), so nothing copies them apart afterwards.

Backward, the pass that matters (docs/models.md, "Gated DeltaNet hybrids"): one pass over the rows
reads x and the output gradient once and writes the input gradient once. A program takes a tile of
BLOCK_R rows, recomputes their pre-activation, takes SiLU's derivative once per element, and gives
each of its first BLOCK_R - (K - 1) tokens the gradient of the K rows that read it along a plain
path (the token's own row and the next K - 1 rows, shifted inside the tile by `tl.gather`); the
last K - 1 rows of a tile are the next tile's first. A row whose taps reach back past its segment's
start into another part of the trie (the first K - 1 rows of a segment: they read the parent's tail)
keeps its gradient aside, and a small second kernel adds those reads to the few tokens they land on
(`RecurrentLayout.conv_remote_*`): deterministic, no atomics. The weight's and bias's gradients are
per-tile partial sums, added up by torch.

Tested on CPU through Triton's interpreter (tests/support/tree_conv_check.py), compiled for sm_90 on CPU
(tests/support/tree_conv_compile_check.py), and on the GPU by tests/gpu/test_gated_deltanet_gpu.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Tile:
    """Rows x channels per program, and its warps."""

    rows: int
    channels: int
    warps: int


# Each tap's load reads 128 contiguous channels of a row (256 bytes in bf16), 8 per thread. Forward:
# 32 rows at 4 warps. Backward: 32 rows at 4 warps, of which the last K - 1 are the next tile's (a
# tenth of the rows computed twice). Register counts: tests/support/tree_conv_compile_check.py's compiles.
# A smaller backward tile (32 rows x 64 channels, 2 warps) was faster alone on an H100 but not in the
# whole Qwen3.5-2B step measured with it: the default is the tile of the better whole step
# (bench/RESULTS.md, "Issue 47, the device calls").
FORWARD_TILE = Tile(rows=32, channels=128, warps=4)
BACKWARD_TILE = Tile(rows=32, channels=128, warps=4)
REMOTE_CHANNELS = 512  # channels per program of the remote-read kernel (a few rows in all)


@triton.jit
def _segment(block, w0, w1, channels, BLOCK_C: tl.constexpr, EVEN: tl.constexpr):
    """The channels of program column `block`: which of the (up to) three outputs it writes, its
    columns there (`local`), which of them exist (all when EVEN: every width a multiple of BLOCK_C),
    that output's width and first channel."""
    nb0 = tl.cdiv(w0, BLOCK_C)
    nb1 = tl.cdiv(w1, BLOCK_C)
    in1 = block >= nb0
    in2 = block >= nb0 + nb1
    first_block = tl.where(in2, nb0 + nb1, tl.where(in1, nb0, 0))
    start = tl.where(in2, w0 + w1, tl.where(in1, w0, 0))
    width = tl.where(in2, channels - w0 - w1, tl.where(in1, w1, w0))
    local = (block - first_block) * BLOCK_C + tl.arange(0, BLOCK_C)
    segment = in1.to(tl.int32) + in2.to(tl.int32)
    if EVEN:
        col_ok = tl.full((BLOCK_C,), True, tl.int1)
    else:
        col_ok = local < width
    return segment, local, col_ok, width, start


@triton.jit
def _pre_activation(x_ptr, w_ptr, b_ptr, index_ptr, rows, cols, row_ok, col_ok, num_rows, channels,
                    x_stride, HAS_BIAS: tl.constexpr, K: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr):  # fmt: skip
    acc = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    for j in tl.static_range(K):
        src = tl.load(index_ptr + rows.to(tl.int64) * K + j, mask=row_ok, other=num_rows)
        ok = (src < num_rows)[:, None] & col_ok[None, :]
        tap = tl.load(x_ptr + src.to(tl.int64)[:, None] * x_stride + cols[None, :], mask=ok, other=0.0)
        w = tl.load(w_ptr + j * channels + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += tap.to(tl.float32) * w[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _forward_kernel(x_ptr, w_ptr, b_ptr, index_ptr, out0_ptr, out1_ptr, out2_ptr, num_rows, channels,
                    x_stride, w0, w1, HAS_BIAS: tl.constexpr, K: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr, EVEN: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    segment, local, col_ok, width, start = _segment(tl.program_id(1), w0, w1, channels, BLOCK_C, EVEN)
    row_ok = rows < num_rows
    cols = start + local
    pre = _pre_activation(x_ptr, w_ptr, b_ptr, index_ptr, rows, cols, row_ok, col_ok, num_rows, channels,
                          x_stride, HAS_BIAS, K, BLOCK_R, BLOCK_C)  # fmt: skip
    out = pre * tl.sigmoid(pre)
    out_ptr = tl.where(segment == 0, out0_ptr, tl.where(segment == 1, out1_ptr, out2_ptr))
    offsets = rows.to(tl.int64)[:, None] * width + local[None, :]
    tl.store(out_ptr + offsets, out.to(out0_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _backward_kernel(x_ptr, w_ptr, b_ptr, index_ptr, dy0_ptr, dy1_ptr, dy2_ptr, dx_ptr, partial_w_ptr,
                     partial_b_ptr, read_slot_ptr, reader_grad_ptr, remote_slot_ptr, remote_local_ptr,
                     num_rows, channels, x_stride, w0, w1, HAS_BIAS: tl.constexpr, K: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, EVEN: tl.constexpr):  # fmt: skip
    """d x of this tile's first BLOCK_R - (K - 1) tokens from the reads along plain paths, and their
    rows' share of d weight (K, C) and d bias (C,); remote readers' d pre-activation kept aside. The
    weight comes transposed, (K, C), as in every kernel here."""
    block = tl.program_id(0)
    owned = BLOCK_R - (K - 1)
    i = tl.arange(0, BLOCK_R)
    rows = block * owned + i
    segment, local, col_ok, width, start = _segment(tl.program_id(1), w0, w1, channels, BLOCK_C, EVEN)
    row_ok = rows < num_rows
    own = row_ok & (i < owned)
    cols = start + local
    pre = _pre_activation(x_ptr, w_ptr, b_ptr, index_ptr, rows, cols, row_ok, col_ok, num_rows, channels,
                          x_stride, HAS_BIAS, K, BLOCK_R, BLOCK_C)  # fmt: skip
    dy_ptr = tl.where(segment == 0, dy0_ptr, tl.where(segment == 1, dy1_ptr, dy2_ptr))
    tile_ok = row_ok[:, None] & col_ok[None, :]
    dy = tl.load(dy_ptr + rows.to(tl.int64)[:, None] * width + local[None, :], mask=tile_ok, other=0.0)
    sig = tl.sigmoid(pre)
    grad_pre = dy.to(tl.float32) * sig * (1.0 + pre * (1.0 - sig))  # silu'(p) = s (1 + p (1 - s))

    # Rows that read across a segment start: their gradient, for the remote-read kernel.
    slot = tl.load(read_slot_ptr + rows, mask=own, other=-1)
    reader = (slot >= 0)[:, None] & col_ok[None, :]
    tl.store(reader_grad_ptr + slot.to(tl.int64)[:, None] * channels + cols[None, :], grad_pre, mask=reader)

    own_grad = tl.where(own[:, None], grad_pre, 0.0)
    if HAS_BIAS:
        tl.store(partial_b_ptr + block * channels + cols, tl.sum(own_grad, axis=0), mask=col_ok)
    for j in tl.static_range(K):
        src = tl.load(index_ptr + rows.to(tl.int64) * K + j, mask=own, other=num_rows)
        ok = (src < num_rows)[:, None] & col_ok[None, :]
        tap = tl.load(x_ptr + src.to(tl.int64)[:, None] * x_stride + cols[None, :], mask=ok, other=0.0)
        partial = tl.sum(own_grad * tap.to(tl.float32), axis=0)
        tl.store(partial_w_ptr + (block * K + j) * channels + cols, partial, mask=col_ok)

    # Token t is read at tap K-1-s by row t + s along a plain path: its own row (s = 0) always, the
    # next rows unless a segment starts between them (then conv_index says another token).
    w_last = tl.load(w_ptr + (K - 1) * channels + cols, mask=col_ok, other=0.0).to(tl.float32)
    acc = grad_pre * w_last[None, :]
    for s in tl.static_range(1, K):
        reader_rows = rows + s
        src = tl.load(index_ptr + reader_rows.to(tl.int64) * K + (K - 1 - s), mask=reader_rows < num_rows,
                      other=num_rows)  # fmt: skip
        shift = tl.minimum(i + s, BLOCK_R - 1)[:, None] + tl.zeros((BLOCK_R, BLOCK_C), tl.int32)
        shifted = tl.gather(grad_pre, shift, 0)
        w = tl.load(w_ptr + (K - 1 - s) * channels + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += tl.where((src == rows)[:, None], shifted * w[None, :], 0.0)

    # Tokens that remote readers read too: the remote-read kernel finishes them from this sum.
    remote = tl.load(remote_slot_ptr + rows, mask=own, other=-1)
    kept = (remote >= 0)[:, None] & col_ok[None, :]
    tl.store(remote_local_ptr + remote.to(tl.int64)[:, None] * channels + cols[None, :], acc, mask=kept)
    offsets = rows.to(tl.int64)[:, None] * channels + cols[None, :]
    tl.store(dx_ptr + offsets, acc.to(dx_ptr.dtype.element_ty), mask=own[:, None] & col_ok[None, :])


@triton.jit
def _remote_kernel(w_ptr, reader_grad_ptr, remote_local_ptr, remote_tokens_ptr, offsets_ptr, entries_ptr,
                   dx_ptr, channels, K: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    """d x[t] of a token read across a segment start: its plain-path sum plus weight[:, j] * d pre[r]
    for every remote read (r, j) of it."""
    remote = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < channels
    acc = tl.load(remote_local_ptr + remote.to(tl.int64) * channels + cols, mask=col_ok, other=0.0)
    first = tl.load(offsets_ptr + remote)
    last = tl.load(offsets_ptr + remote + 1)
    for e in range(first, last):
        entry = tl.load(entries_ptr + e)
        reader, tap = entry // K, entry % K
        w = tl.load(w_ptr + tap * channels + cols, mask=col_ok, other=0.0).to(tl.float32)
        grad = tl.load(reader_grad_ptr + reader.to(tl.int64) * channels + cols, mask=col_ok, other=0.0)
        acc += w * grad
    token = tl.load(remote_tokens_ptr + remote)
    tl.store(dx_ptr + token.to(tl.int64) * channels + cols, acc.to(dx_ptr.dtype.element_ty), mask=col_ok)


def _channel_blocks(widths: tuple[int, ...], block: int) -> int:
    return sum(triton.cdiv(width, block) for width in widths)


def _even(widths: tuple[int, ...], block: int) -> bool:
    return all(width % block == 0 for width in widths)


def _segment_widths(widths: tuple[int, ...]) -> tuple[int, int]:
    """(w0, w1) as the kernels take them: w2 is the rest of the channels."""
    return widths[0], widths[1] if len(widths) > 1 else 0


class TreeConvSilu(torch.autograd.Function):
    """silu(path convolution) of x (P, C) -> one (P, width) tensor per entry of `widths` (they add up
    to C), in x's dtype; weight (C, K), bias (C,) or None; layout: a `RecurrentLayout`."""

    @staticmethod
    def forward(ctx, x, weight, bias, layout, widths):
        if x.stride(1) != 1:  # the kernels read rows through their stride; a column slice is fine
            x = x.contiguous()
        weight_t = weight.T.contiguous()  # (K, C): each tap's weights contiguous along the channels
        num_rows, channels = x.shape
        if sum(widths) != channels or not 1 <= len(widths) <= 3:
            raise ValueError(f"widths {widths} must be 1 to 3 sizes adding up to the {channels} channels")
        if weight.shape[1] > BACKWARD_TILE.rows:
            raise ValueError(
                f"kernel size {weight.shape[1]} is longer than a tile's {BACKWARD_TILE.rows} rows"
            )
        outs = [torch.empty(num_rows, width, dtype=x.dtype, device=x.device) for width in widths]
        pointers = outs + [outs[-1]] * (3 - len(outs))
        tile = FORWARD_TILE
        grid = (triton.cdiv(num_rows, tile.rows), _channel_blocks(widths, tile.channels))
        _forward_kernel[grid](
            x, weight_t, weight_t if bias is None else bias, layout.conv_index, *pointers, num_rows, channels,
            x.stride(0), *_segment_widths(widths), HAS_BIAS=bias is not None, K=weight.shape[1],
            BLOCK_R=tile.rows, BLOCK_C=tile.channels, EVEN=_even(widths, tile.channels), num_warps=tile.warps,
        )  # fmt: skip
        ctx.save_for_backward(x, weight_t, bias)
        ctx.layout, ctx.widths = layout, widths
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, weight_t, bias = ctx.saved_tensors
        layout, widths = ctx.layout, ctx.widths
        grads = [g.contiguous() for g in grads]
        pointers = grads + [grads[-1]] * (3 - len(grads))
        num_rows, channels = x.shape
        kernel_size = weight_t.shape[0]
        tile = BACKWARD_TILE
        blocks = triton.cdiv(num_rows, tile.rows - (kernel_size - 1))
        device = x.device
        grad_x = torch.empty(num_rows, channels, dtype=x.dtype, device=device)
        partial_w = torch.empty(blocks, kernel_size, channels, dtype=torch.float32, device=device)
        partial_b = torch.empty(blocks, channels, dtype=torch.float32, device=device)
        num_readers, num_remote = len(layout.conv_reader_rows), len(layout.conv_remote_tokens)
        reader_grad = torch.empty(max(num_readers, 1), channels, dtype=torch.float32, device=device)
        remote_local = torch.empty(max(num_remote, 1), channels, dtype=torch.float32, device=device)
        _backward_kernel[(blocks, _channel_blocks(widths, tile.channels))](
            x, weight_t, weight_t if bias is None else bias, layout.conv_index, *pointers, grad_x, partial_w,
            partial_b, layout.conv_read_slot, reader_grad, layout.conv_remote_slot, remote_local, num_rows,
            channels, x.stride(0), *_segment_widths(widths), HAS_BIAS=bias is not None, K=kernel_size,
            BLOCK_R=tile.rows, BLOCK_C=tile.channels, EVEN=_even(widths, tile.channels), num_warps=tile.warps,
        )  # fmt: skip
        if num_remote:
            _remote_kernel[(num_remote, triton.cdiv(channels, REMOTE_CHANNELS))](
                weight_t, reader_grad, remote_local, layout.conv_remote_tokens, layout.conv_remote_offsets,
                layout.conv_remote_entries, grad_x, channels, K=kernel_size, BLOCK_C=REMOTE_CHANNELS,
            )  # fmt: skip
        grad_w = partial_w.sum(0).T.to(weight_t.dtype)
        grad_b = None if bias is None else partial_b.sum(0).to(bias.dtype)
        return grad_x, grad_w, grad_b, None, None


def tree_conv_silu(x, weight, bias, layout, widths: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """silu(path convolution) of x (P, C) in the layer order of `layout` (a `RecurrentLayout`), split
    along the channels into tensors of `widths` (each contiguous)."""
    return TreeConvSilu.apply(x, weight, bias, layout, tuple(widths))
