"""The layout of one tree-packed row as the Gated DeltaNet layers read it (`RecurrentLayout`).

Built once per row on the host from the row's segments (`recurrent_layout`) and shared by every
Gated DeltaNet layer of the model: the order the layers compute in (the trie's levels one after
another), each token's predecessors along its path for the convolution, the same reads the other
way for the convolution's backward, and each level's segments for the recurrence. How the layers use
it: docs/models.md, "Gated DeltaNet hybrids".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Level:
    """Segments of one trie depth (in segments): rows start:stop of the layer order, run as one batch
    of the recurrence."""

    start: int
    stop: int
    parent_rows: torch.Tensor  # (B,) row of each segment's parent in the previous level; -1: a root
    cu_seqlens: torch.Tensor  # (B + 1,) int64 segment offsets from `start`, for the varlen kernel
    cu_seqlens_cpu: torch.Tensor  # the same on the host: the kernel plans its chunks with no sync
    # The padded batch of the torch rule (B, Lmax): the row of each slot (a padding slot repeats its
    # segment's first row: finite values that g = beta = 0 keep out of the state), which slots are
    # padding, and the flat slot of each of the level's rows.
    gather: torch.Tensor
    padding: torch.Tensor
    unpad: torch.Tensor


@dataclass(frozen=True)
class RecurrentLayout:
    """What the GDN layers need to know about a packed row, built once per row and shared by every GDN
    layer. A layer computes in *layer order*: the trie's levels one after another (each level's
    segments in packed order), so that every level is a contiguous range of rows and runs on a slice,
    never a gather; `order` maps it to the packed row (None when the two are the same, e.g. a row of
    roots only). The layer gathers its input into that order once and its output back once."""

    num_tokens: int  # real tokens P; the padded row's tail gets zero output
    order: torch.Tensor | None  # (P,) packed index of each row of the layer order; None: the identity
    inverse: torch.Tensor | None  # (P,) layer-order row of each packed token
    conv_index: torch.Tensor  # (P, K) row of the token K-1-j steps back along the path; P = none
    conv_fix_rows: torch.Tensor  # rows whose K-1 predecessors are not simply the rows before them
    # The remote reads, for the convolution kernel's input gradient: (row r, tap j) with conv_index[r, j]
    # a token other than r - (K-1-j), i.e. across a segment start into the parent's tail (a token at a
    # branch point is read by the first rows of every child segment after the first). Every other read
    # follows a plain path. Readers: the rows with a remote read; targets: the tokens they read.
    conv_reader_rows: torch.Tensor  # (F,) rows with a remote read
    conv_read_slot: torch.Tensor  # (P,) int32 position of each row in conv_reader_rows, -1: none
    conv_remote_tokens: torch.Tensor  # (R,) tokens read remotely
    conv_remote_slot: torch.Tensor  # (P,) int32 position of each token in conv_remote_tokens, -1: none
    # The remote reads of conv_remote_tokens[i] are conv_remote_entries[offsets[i]:offsets[i + 1]],
    # each reader slot * K + j.
    conv_remote_offsets: torch.Tensor  # (R + 1,) int64
    conv_remote_entries: torch.Tensor  # (E,) int64
    segment_cu_seqlens: torch.Tensor  # (G + 1,) every segment's row offsets, in layer order
    segment_cu_seqlens_cpu: torch.Tensor
    segment_predecessors: torch.Tensor  # (G, K-1) conv_index[segment start, :K-1]: its path's tail
    levels: tuple[Level, ...]


def _segment_parents(starts: np.ndarray, subtree_end: np.ndarray) -> np.ndarray:
    """(G,) parent segment of each segment (-1 for roots), from the depth-first layout: the parent
    is the innermost earlier segment whose subtree still contains this segment's start."""
    parents = np.full(len(starts), -1, dtype=np.int64)
    open_segments: list[int] = []
    for s, start in enumerate(starts):
        while open_segments and subtree_end[starts[open_segments[-1]]] <= start:
            open_segments.pop()
        if open_segments:
            parents[s] = open_segments[-1]
        open_segments.append(s)
    return parents


def _packed_conv_index(starts, lengths, parents, num_tokens: int, kernel_size: int) -> np.ndarray:
    """(P, K) packed index of the token K-1-j steps back along each token's path (P: none).

    The predecessor along the path is the previous packed token, except at a segment start, where it
    is the parent's last token (none for a root)."""
    previous = np.arange(num_tokens, dtype=np.int64) - 1
    previous[starts] = np.where(parents >= 0, starts[parents] + lengths[parents] - 1, num_tokens)
    columns = [np.arange(num_tokens, dtype=np.int64)]
    extended = np.append(previous, num_tokens)  # index P (no token) stays P
    for _ in range(kernel_size - 1):
        columns.append(extended[columns[-1]])
    return np.stack(columns[::-1], axis=1)  # column K-1 is the token itself


def _remote_reads(conv_index: np.ndarray, natural: np.ndarray) -> dict[str, np.ndarray]:
    """The `RecurrentLayout.conv_reader_rows` ... `conv_remote_entries` arrays of a (P, K) conv_index,
    `natural` being each row's plain-path taps (r - (K-1-j), P before row 0)."""
    num_tokens, kernel_size = conv_index.shape
    remote = (conv_index < num_tokens) & (conv_index != natural)
    reader_rows = np.flatnonzero(remote.any(axis=1))
    read_slot = np.full(num_tokens, -1, dtype=np.int32)
    read_slot[reader_rows] = np.arange(len(reader_rows))
    rows, taps = np.nonzero(remote)
    targets = conv_index[rows, taps]
    by_target = np.argsort(targets, kind="stable")
    remote_tokens, counts = np.unique(targets, return_counts=True)
    remote_slot = np.full(num_tokens, -1, dtype=np.int32)
    remote_slot[remote_tokens] = np.arange(len(remote_tokens))
    return {
        "conv_reader_rows": reader_rows,
        "conv_read_slot": read_slot,
        "conv_remote_tokens": remote_tokens.astype(np.int64),
        "conv_remote_slot": remote_slot,
        "conv_remote_offsets": np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        "conv_remote_entries": (read_slot[rows[by_target]].astype(np.int64) * kernel_size + taps[by_target]),
    }


def recurrent_layout(
    segment_ids: np.ndarray,
    subtree_end: np.ndarray,
    kernel_size: int,
    device: torch.device | str = "cpu",
) -> RecurrentLayout:
    """The layout of one `PackedRow` (its segment_ids and subtree_end arrays) for kernel size K."""
    num_tokens = len(segment_ids)
    if num_tokens == 0:
        raise ValueError("a packed row must hold at least one token")
    starts = np.flatnonzero(np.diff(segment_ids, prepend=-1))  # (G,)
    lengths = np.diff(np.append(starts, num_tokens))
    parents = _segment_parents(starts, subtree_end)
    if np.any((parents >= 0) & (starts[parents] + lengths[parents] > starts)):
        raise ValueError("segments must be laid out depth-first: build rows with asyncgrpo.packing.trie")
    depth = np.zeros(len(starts), dtype=np.int64)
    for s, parent in enumerate(parents):  # parents come before children
        depth[s] = depth[parent] + 1 if parent >= 0 else 0

    # Layer order: segments by depth, then packed position; `first_row` of each segment there.
    by_level = np.lexsort((starts, depth))
    first_row = np.empty_like(starts)
    first_row[by_level] = np.cumsum(lengths[by_level]) - lengths[by_level]
    order = np.repeat(starts[by_level] - first_row[by_level], lengths[by_level]) + np.arange(num_tokens)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(num_tokens)
    packed_conv = _packed_conv_index(starts, lengths, parents, num_tokens, kernel_size)
    conv_index = np.append(inverse, num_tokens)[packed_conv[order]]
    natural = np.arange(num_tokens)[:, None] - np.arange(kernel_size - 1, -1, -1)[None, :]
    natural[natural < 0] = num_tokens  # a plain causal convolution reads zeros before row 0
    identity = bool(np.array_equal(order, np.arange(num_tokens)))

    def tensor(array) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(array), device=device)

    segment_cu = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths[by_level])]), dtype=torch.int64)
    row_in_level = np.zeros(len(starts), dtype=np.int64)
    levels = []
    for level in range(int(depth.max()) + 1):
        members = by_level[depth[by_level] == level]  # in packed order
        row_in_level[members] = np.arange(len(members))
        level_lengths = lengths[members]
        level_start = int(first_row[members[0]])
        offsets = np.arange(int(level_lengths.max()))
        real = offsets[None, :] < level_lengths[:, None]
        gather = np.where(real, first_row[members, None] + offsets[None, :], first_row[members, None])
        cu_seqlens = torch.as_tensor(np.concatenate([[0], np.cumsum(level_lengths)]), dtype=torch.int64)
        levels.append(
            Level(
                start=level_start,
                stop=level_start + int(level_lengths.sum()),
                parent_rows=tensor(np.where(parents[members] >= 0, row_in_level[parents[members]], -1)),
                cu_seqlens=cu_seqlens.to(device),
                cu_seqlens_cpu=cu_seqlens,
                gather=tensor(gather),
                padding=tensor(~real),
                unpad=tensor(np.flatnonzero(real)),
            )
        )
    return RecurrentLayout(
        num_tokens=num_tokens,
        order=None if identity else tensor(order),
        inverse=None if identity else tensor(inverse),
        conv_index=tensor(conv_index),
        conv_fix_rows=tensor(np.flatnonzero((conv_index != natural).any(axis=1))),
        **{name: tensor(array) for name, array in _remote_reads(conv_index, natural).items()},
        segment_cu_seqlens=segment_cu.to(device),
        segment_cu_seqlens_cpu=segment_cu,
        segment_predecessors=tensor(conv_index[first_row[by_level], : kernel_size - 1]),
        levels=tuple(levels),
    )


class _PermutedRows(torch.autograd.Function):
    """x[index] followed by zero rows, `num_rows` rows in all, where `index` is a permutation of x's
    first len(index) rows and `inverse` its inverse: the gradient is then a gather too, with no
    scatter (index_put's backward sorts its indices; index_add's uses atomics)."""

    @staticmethod
    def forward(ctx, x, index, inverse, num_rows: int):
        ctx.save_for_backward(inverse)
        ctx.x_rows = x.shape[0]
        out = x.new_empty(num_rows, *x.shape[1:])
        torch.index_select(x, 0, index, out=out[: len(index)])
        out[len(index) :].zero_()
        return out

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        grad_x = grad.new_empty(ctx.x_rows, *grad.shape[1:])
        torch.index_select(grad, 0, inverse, out=grad_x[: len(inverse)])
        grad_x[len(inverse) :].zero_()
        return grad_x, None, None, None


def to_layer_order(packed: torch.Tensor, layout: RecurrentLayout) -> torch.Tensor:
    """The first P rows of a packed-row tensor (L, ...), in the layout's layer order (P, ...)."""
    if layout.order is None:
        return packed[: layout.num_tokens]
    return _PermutedRows.apply(packed, layout.order, layout.inverse, layout.num_tokens)


def to_packed_order(rows: torch.Tensor, layout: RecurrentLayout, num_rows: int) -> torch.Tensor:
    """Rows in layer order (P, ...) back in packed order, zero rows appended up to `num_rows`."""
    if layout.order is None:
        return F.pad(rows, (0, 0) * (rows.dim() - 1) + (0, num_rows - rows.shape[0]))
    return _PermutedRows.apply(rows, layout.inverse, layout.order, num_rows)
