"""Prefix-trie packing: several samples laid out as one row where a shared prefix is forwarded once.

The rollouts of a group repeat its prompt, and the turns of a multi-turn rollout repeat the
conversation so far; forwarding each shared token once shrinks the forward pass by the packing
ratio, while the attention rule of `PackedRow` still shows each sample exactly its own history. Two
samples share a position only if they also agree on the token it predicts (the one-target rule). The
trie is a radix tree matched a segment at a time. The rules, a worked example and why:
docs/architecture.md#tree-packing.
"""

from __future__ import annotations

import numpy as np

from asyncgrpo.packing.row import PackedRow
from asyncgrpo.records.sample import Sample

NO_TARGET = -1  # a position whose output no loss entry reads


def prediction_targets(token_ids: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """(L,) int64: the token each position's output is trained to predict, NO_TARGET if none.

    Together with token_ids this is the trie key of a position (a collision-free pair of ints).
    """
    targets = np.full(len(token_ids), NO_TARGET, dtype=np.int64)
    targets[:-1] = np.where(trained[1:], token_ids[1:], NO_TARGET)
    return targets


def depth_cost(start: int, end: int) -> int:
    """Attention cost of tokens at depths start..end-1: each token attends to depth + 1 keys."""
    return (end * (end + 1) - start * (start + 1)) // 2


class _Segment:
    """A maximal chain of one-child trie nodes: the tokens at depths depth..depth+n-1 of a path."""

    __slots__ = ("tokens", "targets", "depth", "parent", "children", "by_token", "terminals", "index")

    def __init__(self, tokens: np.ndarray, targets: np.ndarray, depth: int, parent: _Segment | None):
        self.tokens = tokens  # (n,) token ids: a view of the array of the sample that created it
        self.targets = targets  # (n,) int64 target of each node, NO_TARGET while no sample needs one
        self.depth = depth
        self.parent = parent
        self.children: list[_Segment] = []  # creation order, which is also the layout order
        self.by_token: dict[int, list[_Segment]] = {}  # first token id -> children starting with it
        self.terminals: list[tuple[int, int]] = []  # (sample index, length) of samples ending here
        self.index = -1  # position in the depth-first layout, set by PrefixTrie.pack

    def attach(self, child: _Segment) -> None:
        self.children.append(child)
        self.by_token.setdefault(int(child.tokens[0]), []).append(child)


def _match_length(segment: _Segment, tokens: np.ndarray, targets: np.ndarray, pos: int) -> int:
    """How many nodes of `segment` the sample's positions pos.. can share (one-target rule)."""
    m = min(len(segment.tokens), len(tokens) - pos)
    seg_targets, own_targets = segment.targets[:m], targets[pos : pos + m]
    compatible = (seg_targets == own_targets) | (seg_targets == NO_TARGET) | (own_targets == NO_TARGET)
    mismatch = np.flatnonzero((segment.tokens[:m] != tokens[pos : pos + m]) | ~compatible)
    return int(mismatch[0]) if len(mismatch) else m


class PrefixTrie:
    """Samples added one by one to a radix tree; `pack()` lays the tree out as a `PackedRow`.

    The planner keeps one per row, so what a sample would add to a row (`growth`) is one walk down
    the tree, and the counters equal what `pack_row` gives for the same samples in the same order.

    `min_shared_tokens`: a sample that would share fewer tokens than this with the row, while its
    own remaining tokens fill at least that many, shares nothing and starts its own branch.
    Attention runs in blocks of 128 queries x 128 keys: a short shared prefix saves a handful of
    tokens but makes every query block of the long tails below it visit one more key block, which
    was measurably slower than not sharing (docs/architecture.md#tree-packing). Short samples still
    share short prefixes: there the prefix is most of what they forward.
    """

    def __init__(self, min_shared_tokens: int = 0):
        self.min_shared_tokens = min_shared_tokens
        empty = np.zeros(0, dtype=np.int64)
        self._root = _Segment(empty, empty, 0, None)
        self.samples: list[Sample] = []
        self.num_tokens = 0  # forwarded tokens, shared ones counted once
        self.attention_cost = 0  # sum over forwarded tokens of depth + 1
        self.num_unpacked_tokens = 0
        self.num_entries = 0  # trained tokens over all samples = loss entries

    @property
    def num_shared_tokens(self) -> int:
        return self.num_unpacked_tokens - self.num_tokens

    def growth(self, sample: Sample, targets: np.ndarray) -> tuple[int, int]:
        """(forwarded tokens, attention cost) that adding `sample` would add to the row."""
        length = sample.num_tokens
        _, shared = self._walk(sample.token_ids, targets)
        return length - shared, depth_cost(shared, length)

    def add(self, sample: Sample, targets: np.ndarray | None = None) -> None:
        """Insert `sample`; `targets` = prediction_targets(sample), passed when already computed."""
        tokens, length = sample.token_ids, sample.num_tokens
        if targets is None:
            targets = prediction_targets(tokens, sample.trained)
        index = len(self.samples)
        self.samples.append(sample)
        self.num_unpacked_tokens += length
        self.num_entries += sample.num_trained
        if length == 0:
            return
        pieces, pos = self._walk(tokens, targets)
        for segment, k in pieces:  # nodes without a target take this sample's target
            merged = segment.targets[:k]
            np.maximum(merged, targets[segment.depth : segment.depth + k], out=merged)
        self.num_tokens += length - pos
        self.attention_cost += depth_cost(pos, length)

        last, k = pieces[-1] if pieces else (self._root, 0)
        if pos == length:  # already in the tree, ending at or inside `last`
            last.terminals.append((index, length))
            return
        if k < len(last.tokens):  # diverges inside `last`: split it at the branch point
            self._split(last, k)
        elif last is not self._root and not last.children:  # continues a leaf: the chain grows
            last.tokens = np.concatenate([last.tokens, tokens[pos:]])
            last.targets = np.concatenate([last.targets, targets[pos:]])
            last.terminals.append((index, length))
            return
        branch = _Segment(tokens[pos:], targets[pos:], pos, last)
        branch.terminals.append((index, length))
        last.attach(branch)

    def _walk(self, tokens: np.ndarray, targets: np.ndarray) -> tuple[list[tuple[_Segment, int]], int]:
        """Follow the sample down the tree: the (segment, nodes shared) pieces and the shared length.

        At a branch the sample takes the child it shares most nodes with (ties: the oldest child):
        with wildcards several children may start with its token, e.g. a later turn whose earlier
        completion is untrained context next to the groups' trained completions.
        """
        pieces: list[tuple[_Segment, int]] = []
        node, pos, length = self._root, 0, len(tokens)
        while pos < length:
            best, best_k = None, 0
            for child in node.by_token.get(int(tokens[pos]), ()):
                k = _match_length(child, tokens, targets, pos)
                if k > best_k:
                    best, best_k = child, k
            if best is None:
                break
            pieces.append((best, best_k))
            pos += best_k
            if best_k < len(best.tokens):
                break
            node = best
        if 0 < pos < self.min_shared_tokens <= length - pos:
            return [], 0  # too little to share for such a long tail: see min_shared_tokens
        return pieces, pos

    @staticmethod
    def _split(segment: _Segment, k: int) -> None:
        """Cut `segment` after its first k nodes; the rest becomes its only child (for now)."""
        boundary = segment.depth + k
        tail = _Segment(segment.tokens[k:], segment.targets[k:], boundary, segment)
        tail.children, tail.by_token = segment.children, segment.by_token
        for child in tail.children:
            child.parent = tail
        tail.terminals = [t for t in segment.terminals if t[1] > boundary]
        segment.terminals = [t for t in segment.terminals if t[1] <= boundary]
        segment.tokens, segment.targets = segment.tokens[:k], segment.targets[:k]
        segment.children, segment.by_token = [], {}
        segment.attach(tail)

    def _layout(self) -> list[_Segment]:
        """Segments in depth-first order (every ancestor before its descendants), indexed."""
        order: list[_Segment] = []
        stack = self._root.children[::-1]
        while stack:
            segment = stack.pop()
            segment.index = len(order)
            order.append(segment)
            stack.extend(segment.children[::-1])
        return order

    def pack(self) -> PackedRow:
        """Lay the tree out as one row: segments depth-first, one loss entry per trained token."""
        order = self._layout()
        lengths = np.array([len(s.tokens) for s in order], dtype=np.int64)  # (G,) per segment
        starts = np.cumsum(lengths) - lengths
        depths = np.array([s.depth for s in order], dtype=np.int64)
        subtree_sizes = lengths.copy()
        for segment in reversed(order):  # children come after their parent in `order`
            if segment.parent is not self._root:
                subtree_sizes[segment.parent.index] += subtree_sizes[segment.index]
        num_tokens = int(lengths.sum())
        assert num_tokens == self.num_tokens

        terminal_of: list[_Segment | None] = [None] * len(self.samples)
        for segment in order:
            for sample_index, _ in segment.terminals:
                terminal_of[sample_index] = segment
        paths = [self._packed_path(s, terminal_of[i], starts) for i, s in enumerate(self.samples)]
        predict_index = [path[np.flatnonzero(s.trained) - 1] for path, s in zip(paths, self.samples)]

        return PackedRow(
            input_ids=_concat([s.tokens for s in order], np.int64),
            position_ids=np.arange(num_tokens, dtype=np.int64) - np.repeat(starts - depths, lengths),
            segment_ids=np.repeat(np.arange(len(order), dtype=np.int32), lengths),
            subtree_end=np.repeat(starts + subtree_sizes, lengths),
            predict_index=_concat(predict_index, np.int64),
            num_unpacked_tokens=self.num_unpacked_tokens,
            token_multiplicity=np.bincount(_concat(paths, np.int64), minlength=num_tokens),
            **_routings(self.samples, paths, num_tokens),
            **_loss_entries(self.samples),
        )

    def _packed_path(self, sample: Sample, terminal: _Segment | None, starts: np.ndarray) -> np.ndarray:
        """(L,) packed index of each token of the sample, along its own path in the trie."""
        length = sample.num_tokens
        path = []
        while terminal is not None and terminal is not self._root:
            path.append(terminal)
            terminal = terminal.parent
        path.reverse()
        # Position i of the sample sits at packed index starts[segment] + i - segment.depth.
        offsets = [int(starts[s.index]) - s.depth for s in path]
        counts = [min(len(s.tokens), length - s.depth) for s in path]
        return np.arange(length) + np.repeat(np.array(offsets, dtype=np.int64), counts)


def _concat(arrays: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype=dtype)


def _routings(samples: list[Sample], paths: list[np.ndarray], num_tokens: int) -> dict:
    """PackedRow's routed_experts and routed: each sample's recorded experts at its packed positions;
    where samples share a token the first one's routing stands."""
    recorded = [(s.routed_experts, path) for s, path in zip(samples, paths) if s.routed_experts is not None]
    if not recorded:
        return {}
    shapes = {routing.shape[1:] for routing, _ in recorded}
    if len(shapes) > 1:
        raise ValueError(
            f"samples of one row carry routings of different shapes (MoE layers, top_k) {sorted(shapes)}: "
            "they must come from servers running the same model"
        )
    layers, top_k = shapes.pop()
    routed_experts = np.zeros((layers, num_tokens, top_k), dtype=np.int64)
    routed = np.zeros(num_tokens, dtype=bool)
    for routing, path in recorded:
        positions = path[: len(routing)]
        new = ~routed[positions]
        routed_experts[:, positions[new]] = routing[new].transpose(1, 0, 2)
        routed[positions[new]] = True
    return {"routed_experts": routed_experts, "routed": routed}


def _loss_entries(samples: list[Sample]) -> dict:
    """The per-entry fields of PackedRow (all but predict_index), in sample then token order."""
    num_trained = np.array([s.num_trained for s in samples], dtype=np.int64)  # (S,)
    num_entries = int(num_trained.sum())
    entry_starts = np.cumsum(num_trained) - num_trained
    fields = dict(
        target_ids=_concat([s.token_ids[s.trained] for s in samples], np.int64),
        advantages=_concat(
            [
                np.full(s.num_trained, s.advantage, np.float32)
                if s.token_advantages is None
                else s.token_advantages
                for s in samples
            ],
            np.float32,
        ),
        sampler_logprobs=_concat([s.sampler_logprobs for s in samples], np.float32),
        entry_sample=np.repeat(np.arange(len(samples), dtype=np.int32), num_trained),
        num_samples=len(samples),
        sample_versions=np.array([s.model_version for s in samples], dtype=np.int64),
        top_ids=None,
        top_logprobs=None,
        candidate_offsets=None,
        candidate_ids=None,
    )

    with_top = [(s, e) for s, e in zip(samples, entry_starts) if s.top_ids is not None]
    if with_top:  # samples without top-N, or with a smaller N, are padded
        width = max(s.top_ids.shape[1] for s, _ in with_top)
        top_ids = np.full((num_entries, width), -1, dtype=np.int64)
        top_logprobs = np.full((num_entries, width), -np.inf, dtype=np.float32)
        for s, e in with_top:
            n, t = s.top_ids.shape[1], s.num_trained
            top_ids[e : e + t, :n] = s.top_ids
            top_logprobs[e : e + t, :n] = s.top_logprobs
        fields.update(top_ids=top_ids, top_logprobs=top_logprobs)

    with_teacher = [(s, e) for s, e in zip(samples, entry_starts) if s.teacher_ids is not None]
    if with_teacher:  # samples without a teacher, or with a narrower report, are padded
        width = max(s.teacher_ids.shape[1] for s, _ in with_teacher)
        teacher_ids = np.full((num_entries, width), -1, dtype=np.int64)
        teacher_logprobs = np.full((num_entries, width), -np.inf, dtype=np.float32)
        for s, e in with_teacher:
            n, t = s.teacher_ids.shape[1], s.num_trained
            teacher_ids[e : e + t, :n] = s.teacher_ids
            teacher_logprobs[e : e + t, :n] = s.teacher_logprobs
        fields.update(
            teacher_ids=teacher_ids,
            teacher_logprobs=teacher_logprobs,
            sample_teachers=np.array([s.teacher_index for s in samples], dtype=np.int64),
        )

    with_sets = [(s, e) for s, e in zip(samples, entry_starts) if s.candidate_sets is not None]
    if with_sets:  # an entry without a set gets an empty one: the full vocabulary
        sizes = np.zeros(num_entries, dtype=np.int64)
        for s, e in with_sets:
            sizes[e : e + s.num_trained] = [len(c) for c in s.candidate_sets]
        sets = [c for s, _ in with_sets for c in s.candidate_sets]
        fields.update(
            candidate_offsets=np.concatenate([[0], np.cumsum(sizes)]),
            candidate_ids=_concat(sets, np.int64),
        )
    return fields


def pack_row(samples: list[Sample], min_shared_tokens: int = 0) -> PackedRow:
    """Pack `samples` (in this order) into one row as a prefix trie."""
    trie = PrefixTrie(min_shared_tokens)
    for sample in samples:
        trie.add(sample)
    return trie.pack()
