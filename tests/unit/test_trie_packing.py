"""Prefix-trie packing: hand-derived rows, and a brute-force check of the attention rule on random tries."""

from __future__ import annotations

import numpy as np
import pytest

from asyncgrpo.packing.trie import PrefixTrie, pack_row, prediction_targets
from asyncgrpo.records.sample import Sample


def make_sample(tokens, trained, advantage=1.0, group_id=0, logprob_base=0.0, top=None, candidate_sets=None):
    """Sample with sampler log-probs logprob_base - 0.1 * k for its k-th trained token (traceable)."""
    trained = np.array(trained, dtype=bool)
    num_trained = int(trained.sum())
    top_ids, top_logprobs = (None, None) if top is None else top
    sample = Sample(
        token_ids=np.array(tokens, dtype=np.int64),
        trained=trained,
        sampler_logprobs=(logprob_base - 0.1 * np.arange(num_trained)).astype(np.float32),
        advantage=advantage,
        group_id=group_id,
        top_ids=top_ids,
        top_logprobs=top_logprobs,
        candidate_sets=candidate_sets,
    )
    sample.validate()
    return sample


def attention_keys(row, q: int) -> np.ndarray:
    """Packed indices the query at q attends to: kv <= q < subtree_end[kv]."""
    kv = np.arange(q + 1)
    return kv[q < row.subtree_end[: q + 1]]


# The worked example of docs/architecture.md ("Tree packing"): p = [1, 2, 3], a = [10, 11], b = [20, 21].
P1, P2, P3, A1, A2, B1, B2 = 1, 2, 3, 10, 11, 20, 21


def test_worked_example_exactly():
    r0 = make_sample([P1, P2, P3, A1, A2], [0, 0, 0, 1, 1], advantage=0.5, logprob_base=-1.0)
    r1 = make_sample([P1, P2, P3, B1, B2], [0, 0, 0, 1, 1], advantage=-0.5, logprob_base=-2.0)
    row = pack_row([r0, r1])
    np.testing.assert_array_equal(row.input_ids, [P1, P2, P3, A1, A2, P3, B1, B2])
    np.testing.assert_array_equal(row.position_ids, [0, 1, 2, 3, 4, 2, 3, 4])
    np.testing.assert_array_equal(row.segment_ids, [0, 0, 1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(row.subtree_end, [8, 8, 5, 5, 5, 8, 8, 8])
    np.testing.assert_array_equal(row.predict_index, [2, 3, 5, 6])
    np.testing.assert_array_equal(row.target_ids, [A1, A2, B1, B2])
    np.testing.assert_array_equal(row.advantages, np.array([0.5, 0.5, -0.5, -0.5], dtype=np.float32))
    np.testing.assert_array_equal(row.sampler_logprobs, np.array([-1.0, -1.1, -2.0, -2.1], dtype=np.float32))
    np.testing.assert_array_equal(row.entry_sample, [0, 0, 1, 1])
    assert row.top_ids is None and row.top_logprobs is None
    assert row.candidate_offsets is None and row.candidate_ids is None
    assert (row.num_samples, row.num_unpacked_tokens, row.num_tokens, row.num_shared_tokens) == (2, 10, 8, 2)
    assert row.attention_cost == (1 + 2) + 2 * (3 + 4 + 5)
    # Step 4 of the example: S2's queries see p1 p2 (index 0 1) and their own segment (5 6 7).
    np.testing.assert_array_equal(attention_keys(row, 7), [0, 1, 5, 6, 7])
    np.testing.assert_array_equal(attention_keys(row, 4), [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(attention_keys(row, 1), [0, 1])
    assert row.position_ids.dtype == np.int64 and row.segment_ids.dtype == np.int32
    assert row.predict_index.dtype == np.int64 and row.entry_sample.dtype == np.int32


def test_single_sample_is_the_sample():
    sample = make_sample([5, 6, 7, 8, 9, 4], [0, 0, 1, 1, 0, 1])
    row = pack_row([sample])
    np.testing.assert_array_equal(row.input_ids, sample.token_ids)
    np.testing.assert_array_equal(row.position_ids, np.arange(6))
    np.testing.assert_array_equal(row.segment_ids, np.zeros(6))
    np.testing.assert_array_equal(row.subtree_end, np.full(6, 6))
    np.testing.assert_array_equal(row.predict_index, [1, 2, 4])
    np.testing.assert_array_equal(row.target_ids, [7, 8, 4])
    assert row.num_shared_tokens == 0 and row.attention_cost == 21


def test_no_sharing_is_padding_free_packing():
    # Different first tokens: three documents, the usual block-diagonal causal mask.
    samples = [
        make_sample([1, 2, 3], [0, 1, 1]),
        make_sample([4, 5], [0, 1]),
        make_sample([6, 7, 8, 9], [0, 0, 1, 0]),
    ]
    row = pack_row(samples)
    np.testing.assert_array_equal(row.input_ids, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    np.testing.assert_array_equal(row.position_ids, [0, 1, 2, 0, 1, 0, 1, 2, 3])
    np.testing.assert_array_equal(row.segment_ids, [0, 0, 0, 1, 1, 2, 2, 2, 2])
    np.testing.assert_array_equal(row.subtree_end, [3, 3, 3, 5, 5, 9, 9, 9, 9])
    np.testing.assert_array_equal(row.predict_index, [0, 1, 3, 6])
    np.testing.assert_array_equal(row.target_ids, [2, 3, 5, 8])
    np.testing.assert_array_equal(row.entry_sample, [0, 0, 1, 2])
    document = np.repeat([0, 1, 2], [3, 2, 4])
    q, kv = np.meshgrid(np.arange(9), np.arange(9), indexing="ij")
    mask = (kv <= q) & (q < row.subtree_end[kv])
    np.testing.assert_array_equal(mask, (kv <= q) & (document[q] == document[kv]))


def test_identical_samples_share_everything():
    # Same tokens and same targets everywhere: the whole sample is forwarded once, and both
    # samples' entries read the same outputs (each position still predicts one token).
    r0 = make_sample([P1, P2, P3, A1, A2], [0, 0, 0, 1, 1], advantage=1.0)
    r1 = make_sample([P1, P2, P3, A1, A2], [0, 0, 0, 1, 1], advantage=-1.0)
    row = pack_row([r0, r1])
    np.testing.assert_array_equal(row.input_ids, [P1, P2, P3, A1, A2])
    np.testing.assert_array_equal(row.subtree_end, np.full(5, 5))
    np.testing.assert_array_equal(row.predict_index, [2, 3, 2, 3])
    np.testing.assert_array_equal(row.target_ids, [A1, A2, A1, A2])
    np.testing.assert_array_equal(row.advantages, [1.0, 1.0, -1.0, -1.0])
    assert row.num_shared_tokens == 5


def test_same_prompt_same_first_token_then_diverging():
    # p3 predicts a1 in both, so p3 and a1 are shared; a1 predicts 12 in r0 and 13 in r1: split there.
    r0 = make_sample([P1, P2, P3, A1, 12, 14], [0, 0, 0, 1, 1, 1])
    r1 = make_sample([P1, P2, P3, A1, 13, 15], [0, 0, 0, 1, 1, 1])
    row = pack_row([r0, r1])
    np.testing.assert_array_equal(row.input_ids, [P1, P2, P3, A1, 12, 14, A1, 13, 15])
    np.testing.assert_array_equal(row.position_ids, [0, 1, 2, 3, 4, 5, 3, 4, 5])
    np.testing.assert_array_equal(row.segment_ids, [0, 0, 0, 1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(row.subtree_end, [9, 9, 9, 6, 6, 6, 9, 9, 9])
    np.testing.assert_array_equal(row.predict_index, [2, 3, 4, 2, 6, 7])


def test_same_tokens_untrained_and_trained_share_with_wildcard():
    # r1 does not train a1: p3 has no target in r1, so it joins r0's p3 (which predicts a1); a1 then
    # predicts a2 in r0 and b2 in r1, so a1 is forwarded twice.
    r0 = make_sample([P1, P2, P3, A1, A2], [0, 0, 0, 1, 1])
    r1 = make_sample([P1, P2, P3, A1, B2], [0, 0, 0, 0, 1])
    row = pack_row([r0, r1])
    np.testing.assert_array_equal(row.input_ids, [P1, P2, P3, A1, A2, A1, B2])
    np.testing.assert_array_equal(row.position_ids, [0, 1, 2, 3, 4, 3, 4])
    np.testing.assert_array_equal(row.subtree_end, [7, 7, 7, 5, 5, 7, 7])
    np.testing.assert_array_equal(row.predict_index, [2, 3, 5])
    np.testing.assert_array_equal(row.target_ids, [A1, A2, B2])


# Multi-level trie: a system prompt shared by two groups, each group sharing its prompt.
SYSTEM = [100, 101]
A = make_sample(SYSTEM + [200, 201, 10, 11, 12], [0, 0, 0, 0, 1, 1, 1], group_id=0)
A_LONGER = make_sample(SYSTEM + [200, 201, 10, 11, 12, 13], [0, 0, 0, 0, 1, 1, 1, 1], group_id=0)
B = make_sample(SYSTEM + [300, 301, 20, 21], [0, 0, 0, 0, 1, 1], group_id=1)
B_TOOL = make_sample(SYSTEM + [300, 301, 20, 30, 31, 22], [0, 0, 0, 0, 1, 0, 0, 1], group_id=1)  # 30 31: tool


def test_multi_level_trie():
    # A is a strict prefix of A_LONGER: its last token has no target, so it shares all of A_LONGER.
    # In B_TOOL, 20 predicts nothing (the tool token 30 is untrained): it joins B's 20, then splits.
    row = pack_row([A, A_LONGER, B, B_TOOL])
    expected_ids = [100, 101, 200, 201, 10, 11, 12, 13, 300, 301, 20, 21, 30, 31, 22]
    np.testing.assert_array_equal(row.input_ids, expected_ids)
    np.testing.assert_array_equal(row.position_ids, [0, 1, 2, 3, 4, 5, 6, 7, 2, 3, 4, 5, 5, 6, 7])
    np.testing.assert_array_equal(row.segment_ids, [0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 3, 4, 4, 4])
    np.testing.assert_array_equal(row.subtree_end, [15, 15, 8, 8, 8, 8, 8, 8, 15, 15, 15, 12, 15, 15, 15])
    np.testing.assert_array_equal(row.predict_index, [3, 4, 5, 3, 4, 5, 6, 9, 10, 9, 13])
    np.testing.assert_array_equal(row.target_ids, [10, 11, 12, 10, 11, 12, 13, 20, 21, 20, 22])
    np.testing.assert_array_equal(row.entry_sample, [0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3])
    assert (row.num_unpacked_tokens, row.num_tokens) == (29, 15)
    assert row.attention_cost == 15 + (0 + 1) + (2 + 3 + 4 + 5 + 6 + 7) + (2 + 3 + 4) + 5 + (5 + 6 + 7)


def test_prefix_sample_shares_whichever_comes_first():
    assert pack_row([A_LONGER, A]).num_tokens == pack_row([A, A_LONGER]).num_tokens == 8


def test_top_n_and_candidate_sets_are_padded_and_ragged():
    s0 = make_sample(
        [1, 2, 3],
        [0, 1, 1],
        top=(np.array([[2, 7], [3, 8]]), np.array([[-0.1, -2.0], [-0.2, -3.0]], dtype=np.float32)),
        candidate_sets=[np.array([2, 7]), np.array([3])],
    )
    s1 = make_sample([4, 5], [0, 1])  # neither
    s2 = make_sample(
        [6, 7],
        [0, 1],
        top=(np.array([[7, 1, 2]]), np.array([[-0.5, -1.0, -1.5]], dtype=np.float32)),
        candidate_sets=[np.array([7, 1, 2])],
    )
    row = pack_row([s0, s1, s2])
    np.testing.assert_array_equal(row.top_ids, [[2, 7, -1], [3, 8, -1], [-1, -1, -1], [7, 1, 2]])
    expected_logprobs = [[-0.1, -2.0, -np.inf], [-0.2, -3.0, -np.inf], [-np.inf] * 3, [-0.5, -1.0, -1.5]]
    np.testing.assert_array_equal(row.top_logprobs, np.array(expected_logprobs, dtype=np.float32))
    np.testing.assert_array_equal(row.candidate_offsets, [0, 2, 3, 3, 6])
    np.testing.assert_array_equal(row.candidate_ids, [2, 7, 3, 7, 1, 2])
    assert row.top_ids.dtype == np.int64 and row.top_logprobs.dtype == np.float32


def test_empty_row():
    row = pack_row([])
    assert row.num_tokens == 0 and row.num_entries == 0 and row.num_samples == 0
    assert row.top_ids is None and row.candidate_ids is None


# Brute force on random tries.


def random_samples(rng: np.random.Generator, num_samples: int, vocab: int) -> list[Sample]:
    """Samples that fork earlier samples at random depths, with a tiny vocabulary (so tokens also
    coincide by chance) and random trained masks, sometimes inherited to make targets agree."""
    samples: list[Sample] = []
    for _ in range(num_samples):
        tokens = rng.integers(0, vocab, rng.integers(1, 12))
        trained = rng.random(len(tokens)) < 0.6
        if samples and rng.random() < 0.8:
            parent = samples[rng.integers(len(samples))]
            cut = int(rng.integers(0, parent.num_tokens + 1))
            tokens = np.concatenate([parent.token_ids[:cut], tokens])
            inherited = parent.trained[:cut] if rng.random() < 0.7 else rng.random(cut) < 0.6
            trained = np.concatenate([inherited, trained])
        trained[0] = False
        samples.append(make_sample(tokens, trained, logprob_base=-float(len(samples))))
    return samples


def reference_forwarded_tokens(samples: list[Sample]) -> int:
    """The same sharing rule on a plain token-by-token trie of dict nodes: a sample follows, at a
    branch, the compatible child matching most of its tokens before the next branch (ties: oldest),
    a target-less node takes the first target that passes through it."""

    def new_node(token, target):
        return {"token": token, "target": target, "children": []}

    def compatible(node, token, target):
        return node["token"] == token and (node["target"] in (target, -1) or target == -1)

    root, forwarded = new_node(None, None), 0
    for sample in samples:
        tokens = sample.token_ids.tolist()
        targets = [tokens[i + 1] if sample.trained[i + 1] else -1 for i in range(len(tokens) - 1)] + [-1]
        node, pos = root, 0
        while pos < len(tokens):
            best, best_run = None, 0
            for child in node["children"]:
                run, walk = 0, child
                while pos + run < len(tokens) and compatible(walk, tokens[pos + run], targets[pos + run]):
                    run += 1
                    if len(walk["children"]) != 1:
                        break
                    walk = walk["children"][0]
                if run > best_run:
                    best, best_run = child, run
            if best is None:
                best = new_node(tokens[pos], targets[pos])
                node["children"].append(best)
                forwarded += 1
                best_run = 1
            for i in range(pos, pos + best_run):
                if i > pos:
                    best = next(c for c in node["children"] if compatible(c, tokens[i], targets[i]))
                best["target"] = max(best["target"], targets[i])
                node = best
            pos += best_run
    return forwarded


def distinct_keys(samples: list[Sample], with_targets: bool) -> int:
    """Distinct (prefix) paths: a lower bound ignoring targets, an upper bound with exact targets."""
    keys = set()
    for s in samples:
        tokens = s.token_ids.tolist()
        targets = [tokens[i + 1] if s.trained[i + 1] else -1 for i in range(len(tokens) - 1)] + [-1]
        for i in range(len(tokens)):
            path = tuple(zip(tokens[: i + 1], targets[: i + 1])) if with_targets else tuple(tokens[: i + 1])
            keys.add(path)
    return len(keys)


@pytest.mark.parametrize("seed", range(40))
def test_random_tries_reproduce_each_sample_history(seed):
    rng = np.random.default_rng(seed)
    samples = random_samples(rng, num_samples=int(rng.integers(1, 12)), vocab=int(rng.integers(2, 6)))
    row = pack_row(samples)

    assert row.num_tokens == reference_forwarded_tokens(samples)
    assert distinct_keys(samples, with_targets=False) <= row.num_tokens <= distinct_keys(samples, True)
    assert row.num_unpacked_tokens == sum(s.num_tokens for s in samples)
    assert row.attention_cost == int((row.position_ids + 1).sum())

    # Every entry: its query sees exactly the sample's prefix, in order, at positions 0..j-1.
    entry = 0
    for index, sample in enumerate(samples):
        for k, j in enumerate(np.flatnonzero(sample.trained)):
            keys = attention_keys(row, int(row.predict_index[entry]))
            np.testing.assert_array_equal(row.input_ids[keys], sample.token_ids[:j])
            np.testing.assert_array_equal(row.position_ids[keys], np.arange(j))
            assert row.target_ids[entry] == sample.token_ids[j]
            assert row.entry_sample[entry] == index
            assert row.sampler_logprobs[entry] == sample.sampler_logprobs[k]
            entry += 1
    assert entry == row.num_entries

    # One target per packed position.
    for q in np.unique(row.predict_index):
        assert len(np.unique(row.target_ids[row.predict_index == q])) == 1

    # Layout: ancestors first; a segment is one run of consecutive depths sharing one subtree end.
    for seg in np.unique(row.segment_ids):
        where = np.flatnonzero(row.segment_ids == seg)
        np.testing.assert_array_equal(where, np.arange(where[0], where[-1] + 1))
        assert np.all(np.diff(row.position_ids[where]) == 1)
        assert len(np.unique(row.subtree_end[where])) == 1 and row.subtree_end[where[0]] > where[-1]


@pytest.mark.parametrize("seed", range(10))
def test_trie_counters_match_the_packed_row(seed):
    rng = np.random.default_rng(100 + seed)
    samples = random_samples(rng, num_samples=10, vocab=3)
    trie = PrefixTrie()
    for count, sample in enumerate(samples, start=1):
        targets = prediction_targets(sample.token_ids, sample.trained)
        added_tokens, added_cost = trie.growth(sample, targets)
        before = pack_row(samples[: count - 1])
        trie.add(sample, targets)
        after = pack_row(samples[:count])
        assert (trie.num_tokens, trie.attention_cost) == (after.num_tokens, after.attention_cost)
        assert (added_tokens, added_cost) == (
            after.num_tokens - before.num_tokens,
            after.attention_cost - before.attention_cost,
        )


def test_short_prefixes_of_long_tails_are_not_shared_but_short_samples_share():
    prompt = np.arange(16)
    long_samples = [
        Sample(np.concatenate([prompt, 1000 + 300 * k + np.arange(300)]), np.arange(316) >= 16,
               np.zeros(300, np.float32), 1.0, 0)
        for k in range(3)
    ]  # fmt: skip
    assert pack_row(long_samples).num_tokens == 15 + 3 * 301  # shared: all but the last prompt token
    unshared = pack_row(long_samples, min_shared_tokens=128)
    assert unshared.num_tokens == 3 * 316 and unshared.packing_ratio == 1.0
    assert unshared.subtree_end.tolist() == [316] * 316 + [632] * 316 + [948] * 316  # plain packing
    short_samples = [
        Sample(
            np.concatenate([prompt, [500 + k, 600 + k]]), np.arange(18) >= 16, np.zeros(2, np.float32), 1.0, 0
        )
        for k in range(3)
    ]
    assert pack_row(short_samples, min_shared_tokens=128).num_tokens == 15 + 3 * 3
