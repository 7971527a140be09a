"""The row planner: token budget, group locality, oversize drops, closing, balance, exact counters."""

from __future__ import annotations

import numpy as np
import pytest

from asyncgrpo.packing.planner import MicroBatchPlan, Placement, TokenBudgetBatcher
from asyncgrpo.packing.trie import pack_row
from asyncgrpo.records.sample import Sample


def make_sample(tokens, group_id: int, prompt_len: int = 0) -> Sample:
    """Completion tokens (after prompt_len) are trained."""
    tokens = np.asarray(tokens, dtype=np.int64)
    trained = np.arange(len(tokens)) >= max(prompt_len, 1)
    return Sample(tokens, trained, np.zeros(int(trained.sum()), dtype=np.float32), 1.0, group_id)


def random_groups(rng, num_groups: int, group_size: int, prompt_len: int, completion_len: tuple[int, int]):
    """GRPO groups: completions of random length after a shared prompt, in queue (group) order."""
    samples = []
    for group in range(num_groups):
        prompt = rng.integers(0, 1000, prompt_len)
        for _ in range(group_size):
            completion = rng.integers(0, 1000, rng.integers(*completion_len))
            samples.append(make_sample(np.concatenate([prompt, completion]), group, prompt_len))
    return samples


def plan_all(batcher: TokenBudgetBatcher, samples: list[Sample]) -> list[MicroBatchPlan]:
    plans = []
    for sample in samples:
        placement = batcher.offer(sample)
        if placement is Placement.CLOSED:
            plans.append(batcher.close())
            assert batcher.offer(sample) is Placement.PLACED  # opens the next micro-batch
    plans.append(batcher.close())
    return plans


def cost(length: int) -> int:
    """Attention cost of an unshared sample of this length."""
    return length * (length + 1) // 2


def test_validation():
    with pytest.raises(ValueError):
        TokenBudgetBatcher(0, 1)
    with pytest.raises(ValueError):
        TokenBudgetBatcher(10, 0)


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4])
def test_budget_respected_and_counters_exact(num_rows):
    rng = np.random.default_rng(num_rows)
    samples = random_groups(rng, num_groups=12, group_size=4, prompt_len=20, completion_len=(5, 60))
    budget = 150
    plans = plan_all(TokenBudgetBatcher(budget, num_rows), samples)
    placed = [s for plan in plans for row in plan.rows for s in row]
    assert sorted(map(id, placed)) == sorted(map(id, samples))  # every sample exactly once
    assert len(plans) > 1
    for plan in plans:
        assert len(plan.rows) == num_rows
        packed = plan.pack()
        for row, trie, row_packed in zip(plan.rows, plan.tries, packed):
            expected = pack_row(row)
            assert expected.num_tokens <= budget
            assert (trie.num_tokens, trie.attention_cost) == (expected.num_tokens, expected.attention_cost)
            np.testing.assert_array_equal(row_packed.input_ids, expected.input_ids)
            np.testing.assert_array_equal(row_packed.predict_index, expected.predict_index)
        assert plan.row_tokens == [pack_row(row).num_tokens for row in plan.rows]
        assert plan.row_fill_frac == pytest.approx(np.mean(plan.row_tokens) / budget)


def test_group_locality_with_interleaved_groups():
    # Prompts 4 tokens, completions 3: a group's second sample adds 4 tokens to the row holding it.
    a1, a2 = make_sample([1, 2, 3, 4, 10, 11, 12], 0, 4), make_sample([1, 2, 3, 4, 13, 14, 15], 0, 4)
    b1, b2 = make_sample([5, 6, 7, 8, 20, 21, 22], 1, 4), make_sample([5, 6, 7, 8, 23, 24, 25], 1, 4)
    batcher = TokenBudgetBatcher(token_budget=100, num_rows=2)
    assert [batcher.offer(s) for s in (a1, b1, a2, b2)] == [Placement.PLACED] * 4
    plan = batcher.close()
    assert plan.rows == [[a1, a2], [b1, b2]]
    # 14 unpacked per row; 3 prompt tokens forwarded once (the 4th predicts each completion's start).
    assert plan.row_tokens == [11, 11]


def test_group_row_full_spills_to_an_empty_row_then_closes():
    a = [make_sample([1, 2, 3, 4, 10 + i, 20 + i, 30 + i, 40 + i], 0, 4) for i in range(3)]
    batcher = TokenBudgetBatcher(token_budget=10, num_rows=2)
    assert batcher.offer(a[0]) is Placement.PLACED  # 8 tokens in row 0
    assert batcher.offer(a[1]) is Placement.PLACED  # would make row 0 12 > 10: empty row 1
    assert batcher.offer(a[2]) is Placement.CLOSED  # fits in no row
    assert batcher.num_samples == 2
    plan = batcher.close()
    assert plan.rows == [[a[0]], [a[1]]]
    assert batcher.num_samples == 0 and batcher.offer(a[2]) is Placement.PLACED


def test_oversize_dropped_and_counted():
    batcher = TokenBudgetBatcher(token_budget=5, num_rows=1)
    too_long = make_sample(np.arange(6), 0)
    exactly = make_sample(np.arange(5), 1)
    assert batcher.offer(too_long) is Placement.DROPPED_OVERSIZE
    assert batcher.offer(exactly) is Placement.PLACED
    assert batcher.offer(too_long) is Placement.DROPPED_OVERSIZE
    plan = batcher.close()
    assert plan.rows == [[exactly]] and plan.dropped_oversize_count == 2
    assert plan.row_fill_frac == 1.0
    assert batcher.close().dropped_oversize_count == 0  # counted per micro-batch


def test_single_row_takes_new_groups_until_the_budget_is_full():
    batcher = TokenBudgetBatcher(token_budget=25, num_rows=1)
    assert batcher.offer(make_sample(np.arange(10), 0)) is Placement.PLACED
    assert batcher.offer(make_sample(np.arange(10) + 50, 1)) is Placement.PLACED
    assert batcher.offer(make_sample(np.arange(10) + 100, 2)) is Placement.CLOSED  # 30 > 25
    assert (
        batcher.offer(make_sample(np.r_[np.arange(5), 77], 0, 5)) is Placement.PLACED
    )  # group row, +1 token


def test_new_groups_go_to_the_cheapest_row():
    # Costs after adding: a (10 tokens, 55) to row 0; b (3, 6) to row 1; c (4): row 1 -> 6 + 10 = 16
    # beats row 0 -> 65; d (8): row 1 -> 16 + 36 = 52 beats 91; e (4): row 1 -> 62 beats row 0 -> 65.
    a = make_sample(np.arange(10), 0)
    b = make_sample([100, 101, 102], 1)
    c = make_sample([200, 201, 202, 203], 2)
    d = make_sample(np.arange(300, 308), 3)
    e = make_sample([400, 401, 402, 403], 4)
    batcher = TokenBudgetBatcher(token_budget=1000, num_rows=2)
    assert [batcher.offer(s) for s in (a, b, c, d, e)] == [Placement.PLACED] * 5
    plan = batcher.close()
    assert plan.rows == [[a], [b, c, d, e]]
    assert plan.row_attention_costs == [cost(10), cost(3) + 2 * cost(4) + cost(8)] == [55, 62]
    assert plan.row_imbalance == pytest.approx(62 / 58.5)
    assert plan.row_fill_frac == pytest.approx(14.5 / 1000)


def test_a_spill_that_would_raise_the_heaviest_row_closes_the_micro_batch():
    # Budget 12: group 0's row holds 10 tokens (cost 55); row 1 holds 3 (cost 6). A second group-0
    # sample of 10 tokens shares 5 with row 0 but does not fit there (15 > 12); in row 1 it would
    # cost 6 + 55 = 61 > 55: closed. A 6-token one would cost 6 + 21 = 27 <= 55: placed in row 1.
    batcher = TokenBudgetBatcher(token_budget=12, num_rows=2)
    assert batcher.offer(make_sample(np.arange(10), 0)) is Placement.PLACED
    assert batcher.offer(make_sample([100, 101, 102], 1)) is Placement.PLACED
    assert batcher.offer(make_sample(np.r_[np.arange(5), np.arange(60, 65)], 0, 5)) is Placement.CLOSED
    small = make_sample(np.r_[np.arange(3), np.arange(70, 73)], 0, 3)
    assert batcher.offer(small) is Placement.PLACED
    assert batcher.close().rows[1][-1] is small


def test_spill_picks_the_row_cheapest_after_adding():
    # Rows at costs 55 and 15; a 3-token sample (cost 6) goes to the lighter row 1.
    batcher = TokenBudgetBatcher(token_budget=1000, num_rows=2)
    for sample in (make_sample(np.arange(10), 0), make_sample(np.arange(5) + 100, 1)):
        batcher.offer(sample)
    spill = make_sample([500, 501, 502], 2)
    assert batcher.offer(spill) is Placement.PLACED
    assert batcher.close().rows[1][-1] is spill


def test_spill_counts_what_a_row_already_shares():
    # Row 1 holds a sample with the same 8-token system prompt as `spill`: there `spill` forwards only
    # its last 4 tokens (the 8th predicts its first trained token), cost 8 + 9 + 10 + 11 = 38, so
    # row 1 ends at 55 + 38 = 93 < row 2's 28 + 66 = 94, although row 2 is the least loaded now.
    system = list(range(1, 9))
    batcher = TokenBudgetBatcher(token_budget=1000, num_rows=3)
    heavy, same_system, light = np.arange(1000, 1020), system + [50, 51], np.arange(100, 107)
    for sample in (make_sample(heavy, 0), make_sample(same_system, 1, 8), make_sample(light, 2)):
        batcher.offer(sample)
    spill = make_sample(system + [60, 61, 62], 3, 8)
    assert batcher.offer(spill) is Placement.PLACED
    plan = batcher.close()
    assert plan.rows[1][-1] is spill
    assert plan.row_attention_costs == [210, 93, 28] and plan.row_tokens == [20, 14, 7]


@pytest.mark.parametrize("num_rows", [2, 3, 4])
def test_rows_balanced_by_attention_cost(num_rows):
    # Realistic groups (shared prompt, completions of random length): the spill rule keeps every
    # full micro-batch's rows within a few percent of each other.
    rng = np.random.default_rng(7 + num_rows)
    samples = random_groups(rng, num_groups=60, group_size=8, prompt_len=30, completion_len=(20, 200))
    plans = plan_all(TokenBudgetBatcher(token_budget=2048, num_rows=num_rows), samples)[:-1]  # full ones
    imbalance = [plan.row_imbalance for plan in plans]
    assert len(plans) >= 5
    assert all(all(plan.row_tokens) for plan in plans)  # no process idles
    assert np.mean(imbalance) < 1.1 and max(imbalance) < 1.25
    for plan in plans:
        costs = plan.row_attention_costs
        assert plan.row_imbalance == pytest.approx(max(costs) / np.mean(costs))


def test_identical_samples_fill_a_row_by_their_loss_entries():
    # 20 copies of one 10-token sample (a 4-token prompt, 6 trained tokens): the trie forwards 10 tokens
    # whatever the count, so only the loss-entry cap closes the row: 30 // 6 = 5 copies a row.
    copies = [make_sample(list(range(10)), group_id=0, prompt_len=4) for _ in range(20)]
    plans = plan_all(TokenBudgetBatcher(30, 1), copies)
    assert [plan.num_samples for plan in plans] == [5, 5, 5, 5]
    assert all(plan.row_tokens == [10] for plan in plans)
    assert all(trie.num_entries <= 30 for plan in plans for trie in plan.tries)


# -- fixed-count rows (token_budget <= 0, TRL's fixed-count mode) ---------------------------------------


def test_fixed_count_needs_a_sample_count():
    with pytest.raises(ValueError, match="samples_per_row >= 1"):
        TokenBudgetBatcher(-1, 2)
    assert TokenBudgetBatcher(0, 2, samples_per_row=3).fixed_count
    assert not TokenBudgetBatcher(100, 2, samples_per_row=3).fixed_count  # a budget wins


@pytest.mark.parametrize("num_rows, samples_per_row", [(1, 4), (2, 3), (3, 5)])
def test_fixed_count_rows_hold_exactly_n_samples_whatever_their_length(num_rows, samples_per_row):
    rng = np.random.default_rng(num_rows)
    samples = random_groups(rng, num_groups=9, group_size=4, prompt_len=20, completion_len=(5, 300))
    samples.insert(5, make_sample(np.arange(5000), group_id=99))  # longer than any budget: still trained
    plans = plan_all(TokenBudgetBatcher(0, num_rows, samples_per_row=samples_per_row), samples)
    placed = [s for plan in plans for row in plan.rows for s in row]
    assert sorted(map(id, placed)) == sorted(map(id, samples))  # every sample exactly once, none dropped
    assert all(plan.dropped_oversize_count == 0 for plan in plans)
    for plan in plans[:-1]:
        assert [len(row) for row in plan.rows] == [samples_per_row] * num_rows
        assert plan.row_tokens == [pack_row(row).num_tokens for row in plan.rows]
        assert np.isnan(plan.row_fill_frac)  # no budget to fill: not logged
    # The last, partial micro-batch: what was left, no row over the count.
    last = plans[-1]
    assert last.num_samples == len(samples) - (len(plans) - 1) * num_rows * samples_per_row
    assert 0 < last.num_samples <= num_rows * samples_per_row
    assert all(len(row) <= samples_per_row for row in last.rows)


def test_fixed_count_keeps_a_group_in_one_row_and_forwards_its_prompt_once():
    prompt_a, prompt_b = list(range(1, 9)), list(range(101, 109))
    group_a = [make_sample(prompt_a + [20 + i, 30 + i], 0, 8) for i in range(4)]
    group_b = [make_sample(prompt_b + [40 + i, 50 + i], 1, 8) for i in range(4)]
    batcher = TokenBudgetBatcher(0, 2, samples_per_row=4)
    interleaved = [s for pair in zip(group_a, group_b) for s in pair]
    assert [batcher.offer(s) for s in interleaved] == [Placement.PLACED] * 8
    plan = batcher.close()
    assert plan.rows == [group_a, group_b]
    # 7 prompt tokens once (the 8th predicts each completion's start) + 3 per completion, not 4 x 10.
    assert plan.row_tokens == [7 + 4 * 3, 7 + 4 * 3]


def test_fixed_count_spills_a_large_group_and_fills_every_row_before_closing():
    # Rows of 2. Group a (a 5-token prompt, 1-token completions) fills row 0: cost 21, + 11 for the
    # second (its last two tokens: the prompt's last one predicts another target); b (8 tokens, cost 36)
    # is in row 1. a's third sample in row 1 would raise the heaviest row's cost from 36
    # to 36 + 21 = 57, where the token-budget rule closes the micro-batch; fixed-count rows take it:
    # the count, not the cost, decides when a micro-batch is full.
    a = [make_sample([1, 2, 3, 4, 5, 20 + i], 0, 5) for i in range(3)]
    b = make_sample(np.arange(100, 108), 1)
    batcher = TokenBudgetBatcher(0, 2, samples_per_row=2)
    assert [batcher.offer(s) for s in (a[0], b, a[1])] == [Placement.PLACED] * 3
    assert batcher.offer(a[2]) is Placement.PLACED
    assert batcher.offer(make_sample([7, 8], 2)) is Placement.CLOSED  # every row holds 2
    plan = batcher.close()
    assert plan.rows == [a[:2], [b, a[2]]] and plan.row_attention_costs == [32, cost(8) + 21]
