"""The work lists of asyncgrpo's own tree-attention kernel (`packing/tree_attention_kernel.py`): a
packed row's trie cut into query tiles and key tiles, each with the key ranges or query range it
meets. Built on the host from the row's `subtree_end` (numpy, no GPU sync), uploaded once per row and
tile size, shared by every attention layer of the row.

The rule (`packing/row.py`): query q sees key kv iff kv <= q < subtree_end[kv]. Cut the row into
segments, maximal runs of one subtree_end (a trie segment, or a segment and its only child, which
every query sees alike). Then for a segment s = [start, end) with subtree end E:
- a query in s sees every token of each ancestor segment (whole segments: an ancestor's subtree
  holds s) and the tokens of s up to itself (causal);
- a key in s is seen by the queries of s at or after it (causal) and by every query in (end, E): the
  segment's subtree is laid out right after it, depth first.
So a query tile reads a few whole key ranges (the ancestors, merged where they touch; the one that
ends where s starts is merged into s's own causal range) and one causal range; a key tile is read by
one contiguous query range [its first token, E), causal only where it overlaps the tile. Tiles start
at segment starts, so no tile mixes segments and nothing outside the rule is computed apart from
each tile's unused tail. How the kernels use them: docs/gpu-performance.md, "Tree attention".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Columns of a query tile: first token, end token, start of the causal key range, first row of its
# extra key ranges in `key_ranges`, how many.
Q_TILE_COLUMNS = 5
# Columns of a key tile: first token, end token, end of the subtree its queries lie in.
KV_TILE_COLUMNS = 3


@dataclass(frozen=True)
class TreeSegments:
    """A row's attention segments and the key ranges each one's queries read (host arrays)."""

    starts: np.ndarray  # (S,) int64 first token of each segment
    ends: np.ndarray  # (S,) int64 end (exclusive)
    subtree_ends: np.ndarray  # (S,) int64 end of the segment's subtree: its keys' last query + 1
    causal_starts: np.ndarray  # (S,) int64 start of the causal key range (<= start: touching ancestors)
    range_offsets: np.ndarray  # (S + 1,) int64: segment s's extra ranges are ranges[offsets[s]:offsets[s+1]]
    ranges: np.ndarray  # (R, 2) int64 [lo, hi) key ranges of ancestors not touching the causal range


def tree_segments(subtree_end: np.ndarray) -> TreeSegments:
    """Segments and ancestor key ranges of a row. Raises ValueError when `subtree_end` is not a
    depth-first trie layout (pack_row's), which the kernel would otherwise compute wrongly."""
    subtree_end = np.asarray(subtree_end, dtype=np.int64)
    num_tokens = len(subtree_end)
    index = np.arange(num_tokens)
    if num_tokens == 0 or (subtree_end <= index).any() or (subtree_end > num_tokens).any():
        raise ValueError("subtree_end[i] must lie in (i, P]: build rows with asyncgrpo.packing.trie.pack_row")
    starts = np.flatnonzero(np.r_[True, subtree_end[1:] != subtree_end[:-1]])
    ends = np.r_[starts[1:], num_tokens]
    subtree_ends = subtree_end[starts]
    causal_starts = starts.copy()
    offsets, ranges = [0], []
    open_segments: list[int] = []  # ancestors of the current segment, outermost first
    for s, start in enumerate(starts.tolist()):
        while open_segments and subtree_ends[open_segments[-1]] <= start:
            open_segments.pop()
        if open_segments and subtree_ends[s] > subtree_ends[open_segments[-1]]:
            raise ValueError(
                f"segment at token {start} ends its subtree at {subtree_ends[s]}, past its parent's "
                f"{subtree_ends[open_segments[-1]]}: not a trie layout (build rows with pack_row)"
            )
        merged: list[list[int]] = []
        for a in open_segments:
            if merged and merged[-1][1] == starts[a]:
                merged[-1][1] = int(ends[a])
            else:
                merged.append([int(starts[a]), int(ends[a])])
        if merged and merged[-1][1] == start:
            causal_starts[s] = merged.pop()[0]
        ranges += merged
        offsets.append(len(ranges))
        open_segments.append(s)
    return TreeSegments(
        starts, ends, subtree_ends, causal_starts, np.asarray(offsets, dtype=np.int64),
        np.asarray(ranges, dtype=np.int64).reshape(-1, 2),
    )  # fmt: skip


def _cut(starts: np.ndarray, ends: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tiles of at most `size` tokens from each segment's start: (segment, first token, end token)."""
    counts = -(-(ends - starts) // size)
    segment = np.repeat(np.arange(len(starts)), counts)
    first = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    tile_start = starts[segment] + first * size
    return segment, tile_start, np.minimum(tile_start + size, ends[segment])


def query_tiles(segments: TreeSegments, size: int) -> np.ndarray:
    """(T, Q_TILE_COLUMNS) int32 query tiles, the most keys first (longest programs start first)."""
    segment, first, end = _cut(segments.starts, segments.ends, size)
    covered = np.r_[0, np.cumsum(segments.ranges[:, 1] - segments.ranges[:, 0])]
    extra = covered[segments.range_offsets[1:]] - covered[segments.range_offsets[:-1]]
    begin, count = segments.range_offsets[:-1], np.diff(segments.range_offsets)
    causal = segments.causal_starts[segment]
    work = end - causal + extra[segment]
    tiles = np.stack([first, end, causal, begin[segment], count[segment]], axis=1)
    return np.ascontiguousarray(tiles[np.argsort(-work, kind="stable")], dtype=np.int32)


def key_tiles(segments: TreeSegments, size: int) -> np.ndarray:
    """(T, KV_TILE_COLUMNS) int32 key tiles, the most queries first."""
    segment, first, end = _cut(segments.starts, segments.ends, size)
    subtree = segments.subtree_ends[segment]
    tiles = np.stack([first, end, subtree], axis=1)
    return np.ascontiguousarray(tiles[np.argsort(-(subtree - first), kind="stable")], dtype=np.int32)


@dataclass(frozen=True)
class TreeTiles:
    """One row's work lists for one tile size, on the device the attention runs on, each flat int32
    and padded with empty entries (which the kernels skip) to a length that no other list's, nor the
    row's (a multiple of 128), can equal: a compiled layer sees them as dynamic sizes, and its
    compiler would otherwise assume two equal lengths stay equal and compile again when they part."""

    query_tiles: torch.Tensor  # (5 Tq,) length = 1 mod 4: Q_TILE_COLUMNS a tile
    key_ranges: torch.Tensor  # (2 R,) length = 2 mod 4: [lo, hi) pairs
    key_tiles: torch.Tensor  # (3 Tk,) length = 3 mod 4: KV_TILE_COLUMNS a tile


def _padded(rows: np.ndarray, residue: int) -> np.ndarray:
    """`rows` (N, C) flattened, with zero rows appended until the length is `residue` mod 4 (C odd:
    every residue is reached; C = 2: the even ones), and at least 2."""
    columns = rows.shape[1]
    extra = 0
    while (len(rows) + extra) * columns % 4 != residue or (len(rows) + extra) * columns < 2:
        extra += 1
    return np.concatenate([rows, np.zeros((extra, columns), rows.dtype)]).reshape(-1).astype(np.int32)


def _upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)  # no stream sync (see logprobs.to_device)


class TreeLayout:
    """What the kernel needs of one packed row: its segments (host), and per (query tile, key tile)
    size the uploaded work lists, built when the row's masks are (`tree_attention_masks`: a compiled
    layer then only reads them) or at the first call that asks, and reused by every layer."""

    def __init__(self, subtree_end: np.ndarray, length: int, device: torch.device):
        self.segments = tree_segments(subtree_end)
        self.num_tokens = len(subtree_end)
        self.length = length  # the padded row length the attention's inputs have
        self.device = torch.device(device)
        self._tiles: dict[tuple[int, int], TreeTiles] = {}

    def tiles(self, query_tile: int, key_tile: int) -> TreeTiles:
        key = (query_tile, key_tile)
        if key not in self._tiles:
            self._tiles[key] = TreeTiles(
                _upload(_padded(query_tiles(self.segments, query_tile), 1), self.device),
                _upload(_padded(self.segments.ranges, 2), self.device),
                _upload(_padded(key_tiles(self.segments, key_tile), 3), self.device),
            )
        return self._tiles[key]
