"""Sharing the rollout between worker processes: prompts, servers, group ids and one token budget."""

from __future__ import annotations

import multiprocessing

import pytest

from asyncgrpo.rollout.channels import WorkerChannels
from asyncgrpo.rollout.concurrency import TokenAllowance
from asyncgrpo.rollout.worker_shares import owns_stream_index, share_of_range, worker_servers


def test_every_stream_index_has_exactly_one_owner():
    for num_workers in (1, 2, 3, 5):
        for index in range(40):
            owners = [k for k in range(num_workers) if owns_stream_index(index, k, num_workers)]
            assert owners == [index % num_workers]


def test_share_of_range_counts_the_owned_indices():
    for num_workers in (1, 2, 3):
        for worker in range(num_workers):
            for start, stop in [(0, 0), (0, 7), (3, 10), (5, 6), (6, 17)]:
                expected = sum(1 for i in range(start, stop) if i % num_workers == worker)
                assert share_of_range(start, stop, worker, num_workers) == expected


def test_servers_are_dealt_out_and_shared_when_fewer_than_workers():
    urls = ["http://a", "http://b", "http://c", "http://d", "http://e"]
    assert [worker_servers(urls, k, 2) for k in range(2)] == [
        ["http://a", "http://c", "http://e"],
        ["http://b", "http://d"],
    ]
    assert [worker_servers(urls[:2], k, 4) for k in range(4)] == [["http://a"], ["http://b"]] * 2
    assert worker_servers(urls[:1], 0, 1) == ["http://a"]
    with pytest.raises(ValueError, match="no vLLM server"):
        worker_servers([], 0, 2)


def test_the_budget_counts_what_the_other_workers_hold():
    context = multiprocessing.get_context("spawn")
    shared = context.Array("d", 2, lock=False)
    channels = [WorkerChannels.create(context, 0.0, k, 2, shared) for k in range(2)]
    allowances = [TokenAllowance(num_generations=2) for _ in range(2)]
    # Worker 0 learns its estimate from a finished group (2 rollouts of 50 tokens, 100 queued).
    allowances[0].group_started()
    allowances[0].group_finished([50, 50], 100)
    channels[0].publish_committed_tokens(allowances[0].committed_tokens)
    allowances[1].group_started()
    allowances[1].group_finished([60, 40], 100)
    allowances[1].group_started()  # one group in flight, estimated at 100 tokens
    channels[1].publish_committed_tokens(allowances[1].committed_tokens)
    assert channels[0].others_committed_tokens() == 200 and channels[1].others_committed_tokens() == 100
    # Worker 0 holds 100 and the other 200: with a limit of 350 it may start (300 < 350), with 300 not.
    assert allowances[0].may_start_group(350, channels[0].others_committed_tokens())
    assert not allowances[0].may_start_group(300, channels[0].others_committed_tokens())
    assert allowances[0].may_start_group(300)  # alone, 100 < 300: what one worker would have done
