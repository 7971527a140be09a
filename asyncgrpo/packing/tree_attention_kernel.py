"""asyncgrpo's own tree attention on CUDA: forward and backward Triton kernels that walk the trie's
tiles (`packing/tree_tiles.py`) instead of a block mask.

Each query tile (up to `query_tokens` tokens of one segment, times the `groups` query heads that
share a key/value head, stacked as the rows of one tile) reads its ancestors' key ranges whole and its
own causal range; masks are computed only on a range's last block and on the diagonal. The backward
is FlashAttention-2's: a key-tile kernel (dK, dV) that walks the one query range that sees the tile,
and a query-tile kernel (dQ) that walks the forward's ranges again; both recompute the probabilities
from the forward's log-sum-exp. Why and the measurements: docs/gpu-performance.md, "Tree attention".
Inputs (1, H, L, D) with any token and head strides (transformers' transposed views); outputs in
(1, L, H, D) memory, returned as (1, H, L, D) views. Rows past the row's real tokens get zero output
and zero gradients. Only this module imports Triton (CUDA machines; CPU tests run it in Triton's
interpreter, tests/support/tree_attention_kernel_check.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Triton's interpreter (the CPU tests) multiplies bf16 tiles as their raw 16-bit integers: there the
# products are taken in fp32 of the same bf16 values. Compiled kernels never take this branch.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@dataclass(frozen=True)
class KernelConfig:
    """Tile shapes of the three kernels. Rows of a query block are (token, query head of the group)
    pairs: `query_rows` rows hold `query_rows // groups` tokens."""

    query_rows: int  # forward and dQ: rows of a query tile
    key_block: int  # forward and dQ: keys per loop step
    forward_warps: int
    forward_stages: int
    key_rows: int  # dK/dV: keys of a key tile
    backward_query_rows: int  # dK/dV: query rows per loop step
    backward_warps: int
    backward_stages: int


# bf16/fp16 (autocast) by head dim; fp32 (no autocast) takes smaller tiles with IEEE dot products.
# The H100/H200 choice among those bench/tree_attention_kernels.py times: bench/RESULTS.md.
HALF_CONFIGS = {
    128: KernelConfig(128, 64, 8, 3, 64, 64, 8, 3),
    # 64 keys x 256 dims of dK and dV in fp32 fill the registers: a few bytes spill (compile check)
    256: KernelConfig(64, 32, 8, 2, 64, 16, 8, 2),
}
FLOAT_CONFIGS = {
    128: KernelConfig(32, 32, 8, 2, 32, 32, 8, 2),
    256: KernelConfig(32, 16, 8, 1, 16, 32, 8, 1),
}


def block_dim(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def choose_config(head_dim: int, groups: int, dtype: torch.dtype) -> KernelConfig:
    """The tiles for this head dim, head grouping and dtype (a head dim over 256 is refused by the
    caller). Query rows grow to hold at least one token of each of the group's heads."""
    table = FLOAT_CONFIGS if dtype == torch.float32 else HALF_CONFIGS
    config = table[128 if block_dim(head_dim) <= 128 else 256]
    rows = max(config.query_rows, triton.next_power_of_2(groups))
    backward_rows = max(config.backward_query_rows, triton.next_power_of_2(groups))
    return KernelConfig(rows, config.key_block, config.forward_warps, config.forward_stages, config.key_rows,
                        backward_rows, config.backward_warps, config.backward_stages)  # fmt: skip


# fmt: off
@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    if _INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _rows(base, tokens, heads, stride_t, stride_h, offs_d, row_ok, D: tl.constexpr, MASK_ROWS: tl.constexpr,
          EVEN_D: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Load (rows, D), or (D, rows) when TRANSPOSED, of a (token, head) strided tensor."""
    row = tokens.to(tl.int64) * stride_t + heads.to(tl.int64) * stride_h
    if TRANSPOSED:
        ptrs = base + row[None, :] + offs_d[:, None]
        mask = row_ok[None, :] & (offs_d[:, None] < D)
    else:
        ptrs = base + row[:, None] + offs_d[None, :]
        mask = row_ok[:, None] & (offs_d[None, :] < D)
    if MASK_ROWS or not EVEN_D:
        return tl.load(ptrs, mask=mask, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _query_range(acc, l_i, m_i, q, dout, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d,
                 row_token, lo, hi, qk_scale, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 EVEN_D: tl.constexpr, PRECISION: tl.constexpr, BACKWARD: tl.constexpr):
    """Keys [lo, hi) in blocks for a query tile: the forward's online softmax (acc, l_i, m_i), or
    (BACKWARD) dQ into acc from the forward's log-sum-exp. MASKED: the causal rule and the range end
    apply (a range's last block, the diagonal); else every row sees every key of the block."""
    zero = offs_n * 0
    for start in range(lo, hi, BLOCK_N):
        keys = start + offs_n
        key_ok = keys < hi
        allowed = (keys[None, :] <= row_token[:, None]) & key_ok[None, :]
        k_t = _rows(k_base, keys, zero, stride_kt, 0, offs_d, key_ok, D, MASKED, EVEN_D, True)
        scores = _dot(q, k_t, None, PRECISION) * qk_scale
        if BACKWARD:
            v_t = _rows(v_base, keys, zero, stride_vt, 0, offs_d, key_ok, D, MASKED, EVEN_D, True)
            p = tl.math.exp2(scores - lse[:, None])
            if MASKED:
                p = tl.where(allowed, p, 0.0)
            ds = p * (_dot(dout, v_t, None, PRECISION) - delta[:, None])
            acc = _dot(ds.to(k_t.dtype), tl.trans(k_t), acc, PRECISION)
        else:
            v = _rows(v_base, keys, zero, stride_vt, 0, offs_d, key_ok, D, MASKED, EVEN_D, False)
            if MASKED:
                scores = tl.where(allowed, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.math.exp2(scores - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], PRECISION)
            m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _tree_attention_queries(q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, out_ptr, tiles_ptr, ranges_ptr,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dt,
                            stride_dh, stride_ot, stride_oh, num_heads, num_kv_heads, qk_scale, out_scale,
                            G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, BACKWARD: tl.constexpr):
    """One query tile (a tile of `tiles_ptr`) of one key/value head: the forward (out, log-sum-exp)
    or, BACKWARD, dQ (into out_ptr). Ancestors' ranges first, then the causal range."""
    tile, kv_head = tl.program_id(0) // num_kv_heads, tl.program_id(0) % num_kv_heads
    t0 = tl.load(tiles_ptr + tile * 5)
    t1 = tl.load(tiles_ptr + tile * 5 + 1)
    causal_lo = tl.load(tiles_ptr + tile * 5 + 2)
    range_begin = tl.load(tiles_ptr + tile * 5 + 3)
    range_count = tl.load(tiles_ptr + tile * 5 + 4)
    EVEN_D: tl.constexpr = BLOCK_D == D
    offs_m, offs_n, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    row_token = t0 + offs_m // G
    row_head = kv_head * G + offs_m % G
    row_ok = (row_token < t1) & (offs_m < (BLOCK_M // G) * G)
    q = _rows(q_ptr, row_token, row_head, stride_qt, stride_qh, offs_d, row_ok, D, True, EVEN_D, False)
    stat = row_token * num_heads + row_head
    if BACKWARD:
        dout = _rows(dout_ptr, row_token, row_head, stride_dt, stride_dh, offs_d, row_ok, D, True, EVEN_D,
                     False)
        lse = tl.load(lse_ptr + stat, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + stat, mask=row_ok, other=0.0)
    else:
        dout, lse, delta = q, tl.zeros([BLOCK_M], dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30  # finite: a row's first block may be all masked
    for r in range(range_count):  # ancestors' key ranges: whole blocks, then the range's last block
        lo = tl.load(ranges_ptr + (range_begin + r) * 2)
        hi = tl.load(ranges_ptr + (range_begin + r) * 2 + 1)
        full = lo + (hi - lo) // BLOCK_N * BLOCK_N
        acc, l_i, m_i = _query_range(acc, l_i, m_i, q, dout, lse, delta, k_base, v_base, stride_kt, stride_vt,
                                     offs_n, offs_d, row_token, lo, full, qk_scale, D, BLOCK_N, False, EVEN_D,
                                     PRECISION, BACKWARD)
        acc, l_i, m_i = _query_range(acc, l_i, m_i, q, dout, lse, delta, k_base, v_base, stride_kt, stride_vt,
                                     offs_n, offs_d, row_token, full, hi, qk_scale, D, BLOCK_N, True, EVEN_D,
                                     PRECISION, BACKWARD)
    full = causal_lo + (t0 - causal_lo) // BLOCK_N * BLOCK_N  # blocks wholly before the tile's first token
    acc, l_i, m_i = _query_range(acc, l_i, m_i, q, dout, lse, delta, k_base, v_base, stride_kt, stride_vt,
                                 offs_n, offs_d, row_token, causal_lo, full, qk_scale, D, BLOCK_N, False,
                                 EVEN_D, PRECISION, BACKWARD)
    acc, l_i, m_i = _query_range(acc, l_i, m_i, q, dout, lse, delta, k_base, v_base, stride_kt, stride_vt,
                                 offs_n, offs_d, row_token, full, t1, qk_scale, D, BLOCK_N, True, EVEN_D,
                                 PRECISION, BACKWARD)
    if BACKWARD:
        result = acc * out_scale
    else:
        result = acc / l_i[:, None]
        tl.store(lse_ptr + stat, m_i + tl.math.log2(l_i), mask=row_ok)
    rows = row_token.to(tl.int64) * stride_ot + row_head.to(tl.int64) * stride_oh
    tl.store(out_ptr + rows[:, None] + offs_d[None, :], result.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < D))


@triton.jit
def _tree_attention_delta(out_ptr, dout_ptr, delta_ptr, num_rows, num_heads, stride_ot, stride_oh, stride_dt,
                          stride_dh, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """delta[token, head] = sum_d out * d out, in fp32 (the softmax backward's row term)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    tokens, heads = rows // num_heads, rows % num_heads
    out = _rows(out_ptr, tokens, heads, stride_ot, stride_oh, offs_d, row_ok, D, True, False, False)
    dout = _rows(dout_ptr, tokens, heads, stride_dt, stride_dh, offs_d, row_ok, D, True, False, False)
    tl.store(delta_ptr + rows, tl.sum(out.to(tl.float32) * dout.to(tl.float32), 1), mask=row_ok)


@triton.jit
def _key_range(dk, dv, k, v, q_ptr, dout_ptr, lse_ptr, delta_ptr, stride_qt, stride_qh, stride_dt, stride_dh,
               num_heads, kv_head, keys, offs_m, offs_d, lo, stop, limit, qk_scale, G: tl.constexpr,
               D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
               PRECISION: tl.constexpr):
    """dK, dV of a key tile over queries from token lo to stop, BLOCK_M // G tokens a step; MASKED:
    the causal rule and the query limit apply (the diagonal, the subtree's last step)."""
    TOKENS: tl.constexpr = BLOCK_M // G
    CHECK: tl.constexpr = MASKED or TOKENS * G != BLOCK_M  # rows of a step left unused must be masked
    heads = kv_head * G + offs_m % G
    for start in range(lo, stop, TOKENS):
        tokens = start + offs_m // G
        row_ok = (tokens < limit) & (offs_m < TOKENS * G)
        q_t = _rows(q_ptr, tokens, heads, stride_qt, stride_qh, offs_d, row_ok, D, CHECK, EVEN_D, True)
        dout = _rows(dout_ptr, tokens, heads, stride_dt, stride_dh, offs_d, row_ok, D, CHECK, EVEN_D, False)
        stat = tokens * num_heads + heads
        lse = tl.load(lse_ptr + stat, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + stat, mask=row_ok, other=0.0)
        p_t = tl.math.exp2(_dot(k, q_t, None, PRECISION) * qk_scale - lse[None, :])
        if CHECK:
            p_t = tl.where((keys[:, None] <= tokens[None, :]) & row_ok[None, :], p_t, 0.0)
        dv = _dot(p_t.to(dout.dtype), dout, dv, PRECISION)
        ds_t = p_t * (_dot(v, tl.trans(dout), None, PRECISION) - delta[None, :])
        dk = _dot(ds_t.to(q_t.dtype), tl.trans(q_t), dk, PRECISION)
    return dk, dv


@triton.jit
def _tree_attention_keys(q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, tiles_ptr,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dt,
                         stride_dh, stride_gkt, stride_gkh, stride_gvt, stride_gvh, num_heads, num_kv_heads,
                         qk_scale, scale, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr):
    """dK and dV of one key tile of one key/value head: the one query range [k0, subtree end) that
    sees it, causal over the steps that overlap the tile."""
    tile, kv_head = tl.program_id(0) // num_kv_heads, tl.program_id(0) % num_kv_heads
    k0 = tl.load(tiles_ptr + tile * 3)
    k1 = tl.load(tiles_ptr + tile * 3 + 1)
    subtree_end = tl.load(tiles_ptr + tile * 3 + 2)
    EVEN_D: tl.constexpr = BLOCK_D == D
    TOKENS: tl.constexpr = BLOCK_M // G
    offs_n, offs_m, offs_d = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    keys = k0 + offs_n
    key_ok = keys < k1
    zero = offs_n * 0
    k = _rows(k_ptr + kv_head.to(tl.int64) * stride_kh, keys, zero, stride_kt, 0, offs_d, key_ok, D, True,
              EVEN_D, False)
    v = _rows(v_ptr + kv_head.to(tl.int64) * stride_vh, keys, zero, stride_vt, 0, offs_d, key_ok, D, True,
              EVEN_D, False)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    diagonal_end = tl.minimum(k0 + (k1 - k0 + TOKENS - 1) // TOKENS * TOKENS, subtree_end)
    full_end = diagonal_end + (subtree_end - diagonal_end) // TOKENS * TOKENS
    for part in tl.static_range(3):  # the steps over the tile's keys, the whole steps, the last one
        if part == 0:
            lo, stop = k0, diagonal_end
        elif part == 1:
            lo, stop = diagonal_end, full_end
        else:
            lo, stop = full_end, subtree_end
        dk, dv = _key_range(dk, dv, k, v, q_ptr, dout_ptr, lse_ptr, delta_ptr, stride_qt, stride_qh,
                            stride_dt, stride_dh, num_heads, kv_head, keys, offs_m, offs_d, lo, stop,
                            subtree_end, qk_scale, G, D, BLOCK_M, part != 1, EVEN_D, PRECISION)
    mask = key_ok[:, None] & (offs_d[None, :] < D)
    rows = keys.to(tl.int64) * stride_gkt + kv_head.to(tl.int64) * stride_gkh
    tl.store(dk_ptr + rows[:, None] + offs_d[None, :], (dk * scale).to(dk_ptr.dtype.element_ty), mask=mask)
    rows = keys.to(tl.int64) * stride_gvt + kv_head.to(tl.int64) * stride_gvh
    tl.store(dv_ptr + rows[:, None] + offs_d[None, :], dv.to(dv_ptr.dtype.element_ty), mask=mask)
# fmt: on


def _token_strides(x: torch.Tensor) -> tuple[int, int]:
    """(token stride, head stride) of a (1, H, L, D) tensor whose last dim is contiguous."""
    return x.stride(2), x.stride(1)


def _precision(dtype: torch.dtype) -> str | None:
    return "ieee" if dtype == torch.float32 else None  # fp32: exact products, not TF32


def _query_tiles(query_tiles, key_ranges, q, k, v, dout, lse, delta, out, scale: float, backward: bool):
    """Launch the query-tile kernel: the forward into out (1, L, Hq, D) and lse, or dQ into out."""
    _, num_heads, _, head_dim = q.shape
    num_kv_heads = k.shape[1]
    config = choose_config(head_dim, num_heads // num_kv_heads, q.dtype)
    _tree_attention_queries[(query_tiles.numel() // 5 * num_kv_heads,)](
        q, k, v, dout, lse, delta, out, query_tiles, key_ranges, *_token_strides(q), *_token_strides(k),
        *_token_strides(v), *_token_strides(dout), out.stride(1), out.stride(2), num_heads, num_kv_heads,
        scale * LOG2E, scale if backward else 1.0, G=num_heads // num_kv_heads, D=head_dim,
        BLOCK_D=block_dim(head_dim), BLOCK_M=config.query_rows, BLOCK_N=config.key_block,
        PRECISION=_precision(q.dtype), BACKWARD=backward, num_warps=config.forward_warps,
        num_stages=config.forward_stages,
    )  # fmt: skip


# The kernels as torch operators: a compiled decoder layer keeps them inside its graph (no graph
# break, its own fusions around them), and autograd reaches the backward operator. Outputs are zeroed
# first: rows past the real tokens are never written, and the padding gets zero output and gradients.
@torch.library.custom_op("asyncgrpo::tree_attention", mutates_args=())
def tree_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_tiles: torch.Tensor,
    key_ranges: torch.Tensor,
    key_tiles: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out (1, L, Hq, D) and the log-sum-exp (L, Hq) in base 2, for q (1, Hq, L, D), k, v (1, Hkv, L, D)."""
    _, num_heads, length, head_dim = q.shape
    out = q.new_zeros(1, length, num_heads, head_dim)
    lse = q.new_zeros(length, num_heads, dtype=torch.float32)
    _query_tiles(query_tiles, key_ranges, q, k, v, q, lse, lse, out, scale, backward=False)
    return out, lse


@tree_attention_op.register_fake
def _(q, k, v, query_tiles, key_ranges, key_tiles, scale):
    _, num_heads, length, head_dim = q.shape
    return q.new_empty(1, length, num_heads, head_dim), q.new_empty(length, num_heads, dtype=torch.float32)


@torch.library.custom_op("asyncgrpo::tree_attention_backward", mutates_args=())
def tree_attention_backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    query_tiles: torch.Tensor,
    key_ranges: torch.Tensor,
    key_tiles: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq (1, L, Hq, D), dk and dv (1, L, Hkv, D) from d out (1, L, Hq, D)."""
    _, num_heads, length, head_dim = q.shape
    num_kv_heads, groups = k.shape[1], num_heads // k.shape[1]
    config = choose_config(head_dim, groups, q.dtype)
    grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
    dout = grad_out.transpose(1, 2)  # (1, Hq, L, D), the layout the kernels index
    delta = torch.empty(length, num_heads, dtype=torch.float32, device=q.device)
    _tree_attention_delta[(triton.cdiv(length * num_heads, 64),)](
        out, grad_out, delta, length * num_heads, num_heads, out.stride(1), out.stride(2),
        grad_out.stride(1), grad_out.stride(2), D=head_dim, BLOCK_D=block_dim(head_dim), BLOCK_R=64,
        num_warps=4,
    )  # fmt: skip
    dq = q.new_zeros(1, length, num_heads, head_dim)
    dk = k.new_zeros(1, length, num_kv_heads, head_dim)
    dv = v.new_zeros(1, length, num_kv_heads, head_dim)
    _tree_attention_keys[(key_tiles.numel() // 3 * num_kv_heads,)](
        q, k, v, dout, lse, delta, dk, dv, key_tiles, *_token_strides(q), *_token_strides(k),
        *_token_strides(v), *_token_strides(dout), dk.stride(1), dk.stride(2), dv.stride(1), dv.stride(2),
        num_heads, num_kv_heads, scale * LOG2E, scale, G=groups, D=head_dim, BLOCK_D=block_dim(head_dim),
        BLOCK_N=config.key_rows, BLOCK_M=config.backward_query_rows, PRECISION=_precision(q.dtype),
        num_warps=config.backward_warps, num_stages=config.backward_stages,
    )  # fmt: skip
    _query_tiles(query_tiles, key_ranges, q, k, v, dout, lse, delta, dq, scale, backward=True)
    return dq, dk, dv


@tree_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, query_tiles, key_ranges, key_tiles, scale):
    _, num_heads, length, head_dim = q.shape
    return (q.new_empty(1, length, num_heads, head_dim), k.new_empty(1, length, k.shape[1], head_dim),
            v.new_empty(1, length, v.shape[1], head_dim))  # fmt: skip


def _setup_context(ctx, inputs, output):
    q, k, v, query_tiles, key_ranges, key_tiles, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], query_tiles, key_ranges, key_tiles)
    ctx.scale = scale


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, query_tiles, key_ranges, key_tiles = ctx.saved_tensors
    dq, dk, dv = tree_attention_backward_op(grad_out, q, k, v, out, lse, query_tiles, key_ranges, key_tiles,
                                            ctx.scale)  # fmt: skip
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None, None, None


tree_attention_op.register_autograd(_backward, setup_context=_setup_context)


def tile_sizes(head_dim: int, groups: int, dtype: torch.dtype) -> tuple[int, int]:
    """(tokens of a query tile, tokens of a key tile) the kernels take for these heads and dtype."""
    config = choose_config(head_dim, groups, dtype)
    return config.query_rows // groups, config.key_rows


def tree_attention_kernel(q, k, v, layout, scale: float | None = None) -> torch.Tensor:
    """Tree attention of q (1, Hq, L, D) over k, v (1, Hkv, L, D) -> (1, Hq, L, D) (a view of
    (1, L, Hq, D) memory), for the packed row `layout` (a `packing.tree_tiles.TreeLayout`) describes."""
    if q.shape[0] != 1:
        raise ValueError(f"a packed row is one sequence (batch 1), got batch {q.shape[0]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are no multiple of {k.shape[1]} key/value heads")
    if q.shape[-1] > 256:
        raise ValueError(f"head dim {q.shape[-1]} > 256: the kernel's tiles hold at most 256")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}): cast them first")
    if q.shape[2] != layout.length:
        raise ValueError(f"inputs have {q.shape[2]} rows, the layout's padded row {layout.length}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    tiles = layout.tiles(*tile_sizes(q.shape[-1], q.shape[1] // k.shape[1], q.dtype))
    out, _ = tree_attention_op(q, k, v, tiles.query_tiles, tiles.key_ranges, tiles.key_tiles, float(scale))
    return out.transpose(1, 2)
