"""The trainer's intake and prompt ledger: what counts toward an epoch, what the resume position is,
and what `rollout/queue_size` measures. Hand-built samples and group results; no server."""

from __future__ import annotations

import numpy as np
import pytest

from asyncgrpo.records.metrics import MetricsWindow
from asyncgrpo.records.sample import Sample
from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.trainer.intake import SampleIntake
from asyncgrpo.trainer.prompt_ledger import PromptLedger


def test_stale_or_oversize_prompts_are_resolved_but_not_counted_for_the_epoch():
    ledger = PromptLedger()
    ledger.add_group(0, 2)  # two samples: one trained, one dropped stale -> counted
    ledger.add_group(1, 1)  # its only sample dropped (stale or oversize) -> resolved, not counted
    ledger.add_group(2, 0)  # equal rewards or filtered: no sample -> counted at once
    assert (ledger.epoch_prompts, ledger.state()) == (1, (0, [2]))
    ledger.sample_done(1, trained=False)
    assert (ledger.epoch_prompts, ledger.state()) == (1, (0, [1, 2]))
    ledger.sample_done(0, trained=False)
    assert ledger.state() == (0, [1, 2]), "stream 0 still has a sample pending"
    ledger.sample_done(0, trained=True)
    assert (ledger.epoch_prompts, ledger.state()) == (2, (3, []))


def test_a_resumed_ledger_keeps_its_count_and_position():
    ledger = PromptLedger(start_index=5, consumed_after=[6, 8], epoch_prompts=7)
    assert ledger.state() == (5, [6, 8])
    ledger.add_group(5, 1)
    ledger.sample_done(5, trained=True)
    assert (ledger.epoch_prompts, ledger.state()) == (8, (7, [8]))


class QueueDouble:
    """The two calls SampleIntake makes on the rollout worker, over a list of group results."""

    def __init__(self, results: list[GroupResult]):
        self.results = list(results)
        self.allowance = None

    def next_result(self, timeout: float) -> GroupResult | None:
        if self.results:
            return self.results.pop(0)
        if timeout > 0:  # the real worker would block here: a test must not
            raise AssertionError("the intake waited for more samples than the test queued")
        return None

    def publish_allowance(self, cumulative_tokens: float) -> None:
        self.allowance = cumulative_tokens


def sample(stream_index: int, model_version: int = 0, length: int = 10) -> Sample:
    trained = np.zeros(length, dtype=bool)
    trained[length // 2 :] = True
    return Sample(
        token_ids=np.arange(100 * stream_index, 100 * stream_index + length, dtype=np.int64),
        trained=trained,
        sampler_logprobs=np.zeros(int(trained.sum()), dtype=np.float32),
        advantage=1.0,
        group_id=stream_index,
        stream_index=stream_index,
        model_version=model_version,
    )


def make_intake(results: list[GroupResult], max_staleness: int = 1) -> tuple[SampleIntake, PromptLedger]:
    ledger = PromptLedger()
    intake = SampleIntake(
        QueueDouble(results), ledger, max_staleness, token_budget=25, num_rows=1, rows_per_step=1
    )
    return intake, ledger


def group(stream_index: int, samples: list[Sample]) -> GroupResult:
    return GroupResult(stream_index, 0, stream_index, stream_index, samples)


def test_queue_size_counts_samples_and_stale_prompts_do_not_count_for_the_epoch():
    # Group 0 is two versions old (stale at max_staleness=1); groups 1 and 2 are fresh. The two
    # identical samples of group 1 share all 10 tokens; group 2's 20 tokens do not fit the 25-token
    # row beside them, so it closes the micro-batch and stays queued for the next step.
    results = [
        group(0, [sample(0, model_version=0)]),
        group(1, [sample(1, model_version=2), sample(1, model_version=2)]),
        group(2, [sample(2, model_version=2, length=20)]),
    ]
    intake, ledger = make_intake(results)
    window = MetricsWindow()
    batch = intake.next_step(gradient_accumulation_steps=1, metrics=window, model_version=2)
    logged = window.summarize()
    assert logged["rollout/queue_size"] == 4, "four samples were waiting (three group results)"
    assert logged["sample/dropped_stale_count"] == 1
    assert [s.stream_index for s in batch.samples] == [1, 1]
    # Stream 0 is resolved (resume skips it) but was never trained, so it does not count.
    assert ledger.state() == (2, [])
    assert ledger.epoch_prompts == 1


def test_a_malformed_sample_is_refused_where_it_enters_the_trainer():
    broken = sample(0)
    broken.sampler_logprobs = broken.sampler_logprobs[:-1]  # one trained token without its log-prob
    intake, _ = make_intake([group(0, [broken])])
    with pytest.raises(ValueError, match="one sampler log-prob per trained token"):
        intake.next_step(gradient_accumulation_steps=1, metrics=MetricsWindow(), model_version=0)


@pytest.mark.parametrize(
    "break_it, invariant",
    [
        (lambda s: setattr(s, "trained", s.trained[:-1]), "trained mask must match token_ids"),
        (lambda s: s.trained.__setitem__(0, True), "first token cannot be trained"),
        (lambda s: setattr(s, "top_ids", np.zeros((5, 2), np.int64)), "same shape"),
        (
            lambda s: (
                setattr(s, "top_ids", np.zeros((4, 2), np.int64)),
                setattr(s, "top_logprobs", np.zeros((4, 2), np.float32)),
            ),
            "one top-N row per trained token",
        ),
        (lambda s: setattr(s, "candidate_sets", [np.arange(3)] * 4), "one candidate set per trained token"),
    ],
)
def test_each_sample_invariant_is_a_value_error_naming_it(break_it, invariant):
    good = sample(0)
    good.validate()
    break_it(good)
    with pytest.raises(ValueError, match=invariant):
        good.validate()


@pytest.mark.parametrize("max_staleness, factor", [(0, 1), (1, 1), (3, 3)])
def test_the_allowance_is_max_staleness_steps_of_tokens_beyond_what_was_consumed(max_staleness, factor):
    """max_staleness counts steps of tokens here (docs/architecture.md#the-token-allowance): before
    the first step a step is assumed full (token_budget x rows); after it, the last step's tokens."""
    results = [group(1, [sample(1, model_version=0)] * 2), group(2, [sample(2, model_version=0, length=20)])]
    intake, _ = make_intake(results, max_staleness=max_staleness)
    assert intake.worker.allowance == factor * 25  # token_budget 25, one row per step
    intake.next_step(gradient_accumulation_steps=1, metrics=MetricsWindow(), model_version=0)
    consumed = 2 * 10  # group 1 trained; group 2 did not fit beside it and stays queued
    assert intake.worker.allowance == consumed + factor * consumed


def test_an_oversize_sample_is_dropped_and_its_prompt_not_counted_for_the_epoch():
    results = [group(0, [sample(0, length=30)]), group(1, [sample(1)]), group(2, [sample(2, length=20)])]
    intake, ledger = make_intake(results)  # token_budget 25: the 30-token sample cannot fit any row
    window = MetricsWindow()
    batch = intake.next_step(gradient_accumulation_steps=1, metrics=window, model_version=0)
    assert [s.stream_index for s in batch.samples] == [1]
    assert window.summarize()["batch/dropped_oversize_count"] == 1
    assert ledger.epoch_prompts == 1, "prompt 0 was resolved without training: it does not count"
