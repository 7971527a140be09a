"""Elastic servers without a server: the trainer's roster of live, lost and joining servers, the
client's choice among them, the worker's cap over its share, and the server list file. Against
real servers: tests/integration/test_elastic_servers.py; the NCCL group's side:
tests/unit/test_nccl_weight_sync.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time

import pytest

pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

from aiohttp import web  # noqa: E402
from test_client_faults import GOOD_BODY, SAMPLING, serve  # noqa: E402

from asyncgrpo.config import AsyncGRPOConfig  # noqa: E402
from asyncgrpo.generation.client import VLLMClient, policy_label  # noqa: E402
from asyncgrpo.generation.errors import ServerLostError  # noqa: E402
from asyncgrpo.generation.server_info import ServerInfo, server_differences  # noqa: E402
from asyncgrpo.generation.server_set import ServerSet  # noqa: E402
from asyncgrpo.records.metrics import MetricsWindow  # noqa: E402
from asyncgrpo.rollout.concurrency import rescaled_cap  # noqa: E402
from asyncgrpo.trainer.server_roster import Probe, ServerRoster, read_server_list  # noqa: E402

A, B, C = "http://a:8000", "http://b:8000", "http://c:8000"
INFO = ServerInfo(dtype="float32", logprobs_mode="processed_logprobs", device="cpu")


class FakeServers:
    """What the roster asks the servers through its client, answered from a table."""

    def __init__(self):
        self.info = {A: INFO, B: INFO, C: INFO}
        self.model = {A: "tiny", B: "tiny", C: "tiny"}
        self.published: list[list[str]] = []

    async def supports_token_generate(self, urls=None):
        return True

    async def models(self, url=None):
        return [{"id": self.model[url], "max_model_len": 1024}]

    async def server_info(self, url=None):
        return self.info[url]

    def set_servers(self, urls, admissions, live=None):
        self.admissions = dict(admissions)


class ImmediateLoop:
    """The trainer's HTTP loop, run inline; nothing runs in the background (the tests set the probes'
    results themselves)."""

    def run(self, coroutine, timeout=None):
        return asyncio.run(coroutine)

    def submit(self, coroutine):
        coroutine.close()
        return concurrent.futures.Future()


class Resender:
    """A weight sync that keeps what it sent (filesystem, LoRA) or not (NCCL)."""

    def __init__(self, can_resend: bool = True):
        self.can_resend = can_resend
        self.resent: list[tuple[int, list[str]]] = []

    def resend(self, version, urls):
        self.resent.append((version, list(urls)))
        return []


def roster_of(urls, tmp_path=None, listed=None, can_resend=True, **config):
    servers = FakeServers()
    urls_file = None
    if listed is not None:
        urls_file = tmp_path / "servers.txt"
        urls_file.write_text("\n".join(listed))
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path or "out"),
        vllm_server_base_url=",".join(urls),
        vllm_server_urls_file=str(urls_file) if urls_file else None,
        report_to="none",
        **config,
    )
    window = MetricsWindow()
    roster = ServerRoster(
        servers, ImmediateLoop(), Resender(can_resend), INFO, "tiny", 1024, args,
        publish=lambda live, admissions: servers.published.append(live), window=window,
    )  # fmt: skip
    roster.start(urls)
    roster.after_sync(urls, missed=[])  # the starting weights reached every server
    return roster, servers, window


def probe(roster, url, label=None, failures=0, listed=None):
    """A probe of `url` that started now (after every change so far)."""
    time.sleep(0.001)  # a later clock reading than the last change
    roster.probe.results[url] = Probe(time.monotonic(), label, failures, "" if label else "refused")
    if listed is not None:
        roster.probe.listed = listed


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


def sums(window: MetricsWindow) -> dict[str, float]:
    return {name: stat.result() for name, stat in window.stats().items()}


def test_a_lost_server_leaves_and_rejoins_with_the_served_version_when_it_answers():
    roster, servers, window = roster_of([A, B])
    probe(roster, A, label=policy_label(3))
    probe(roster, B, failures=1)
    assert roster.refresh(version=3) == [] and roster.live() == [A, B], "one failed probe is not a loss"
    probe(roster, B, failures=2)
    roster.refresh(version=3)
    assert roster.live() == [A] and servers.published[-1] == [A]
    probe(roster, B, label="default")  # back, from its checkpoint
    assert roster.refresh(version=4) == []
    assert roster.weight_sync.resent == [(4, [B])] and roster.live() == [A, B]
    assert servers.admissions == {A: 1, B: 2}, "a new admission: the workers forget B's failure"
    stats = sums(window)
    assert stats["rollout/servers_lost_count"] == 1 and stats["rollout/servers_joined_count"] == 1


def test_a_server_that_restarted_between_probes_is_given_the_weights_again():
    roster, servers, window = roster_of([A])
    probe(roster, A, label="default")  # vLLM's own label: it runs its checkpoint, not the trainer's
    roster.refresh(version=2)
    assert roster.live() == [] and sums(window)["rollout/servers_lost_count"] == 1
    probe(roster, A, label="default")
    roster.refresh(version=2)
    assert roster.live() == [A] and roster.weight_sync.resent == [(2, [A])]
    assert sums(window)["rollout/server_restarts"] == 1


def test_without_a_resend_a_server_back_waits_for_a_full_sync():
    """NCCL keeps nothing to resend: the server is returned for a sync with every process."""
    roster, servers, _ = roster_of([A, B], can_resend=False)
    probe(roster, B, failures=2)
    roster.refresh(version=1)
    probe(roster, B, label=policy_label(1))
    assert roster.refresh(version=1) == [B] and roster.live() == [A]
    roster.after_sync([A, B], missed=[], joining=[B])
    assert roster.live() == [A, B]


def test_a_server_the_sync_could_not_reach_is_lost():
    roster, servers, window = roster_of([A, B])
    roster.after_sync([A, B], missed=[B])
    assert roster.live() == [A] and sums(window)["rollout/servers_lost_count"] == 1


def test_servers_join_and_leave_through_the_list_file(tmp_path, caplog):
    roster, servers, window = roster_of([A], tmp_path, listed=[])
    probe(roster, B, label="default", listed=[B, C])
    servers.info[C] = ServerInfo(dtype="bfloat16", logprobs_mode="processed_logprobs", device="cpu")
    probe(roster, C, label="default")
    with caplog.at_level(logging.WARNING):
        roster.refresh(version=5)
        roster.refresh(version=5)
    assert roster.live() == [A, B] and roster.weight_sync.resent == [(5, [B])]
    refusals = [record.message for record in caplog.records if "not taken into the run" in record.message]
    assert len(refusals) == 1 and "--dtype 'bfloat16', not 'float32'" in refusals[0], "said once"
    probe(roster, B, label=policy_label(5), listed=[C])  # B taken out of the list: it leaves
    roster.refresh(version=5)
    assert roster.live() == [A] and "rollout/servers_lost_count" not in sums(window)
    probe(roster, A, label=policy_label(5), listed=[])  # A is configured: the list cannot remove it
    roster.refresh(version=5)
    assert roster.live() == [A]


def test_the_run_stops_when_no_server_is_left_for_the_timeout():
    roster, _, _ = roster_of([A], vllm_server_timeout=0.2)
    probe(roster, A, failures=2)
    roster.refresh(version=1)  # lost: the clock starts
    time.sleep(0.3)
    with pytest.raises(
        ServerLostError, match=r"no vLLM server has been live .* lost: http://a:8000"
    ) as error:
        roster.refresh(version=1)
    assert not error.value.run_can_go_on and error.value.lost == (A,)


def test_the_run_stops_when_more_than_the_allowed_fraction_is_lost():
    roster, _, _ = roster_of([A, B, C], max_lost_server_fraction=0.5)
    probe(roster, A, failures=2)
    roster.refresh(version=1)  # one of three: a third, within a half
    probe(roster, B, failures=2)
    with pytest.raises(
        ServerLostError, match="2 of 3 vLLM servers are lost .* max_lost_server_fraction=0.5"
    ) as error:
        roster.refresh(version=1)
    assert not error.value.run_can_go_on and set(error.value.lost) == {A, B}


def test_the_server_list_file_is_read_line_by_line(tmp_path):
    path = tmp_path / "servers.txt"
    assert read_server_list(path) == [], "not written yet: no server"
    path.write_text("# servers of job 42\nhttp://a:8000/\n\n  http://b:8000  # node b\nhttp://a:8000\n")
    assert read_server_list(path) == ["http://a:8000", "http://b:8000"]


def test_a_joining_server_must_match_the_first_servers_flags():
    assert server_differences(INFO, INFO) == []
    other = ServerInfo(dtype="bfloat16", logprobs_mode="raw_logprobs", device="cpu")
    assert server_differences(INFO, other) == [
        "--dtype 'bfloat16', not 'float32'",
        "--logprobs-mode 'raw_logprobs', not 'processed_logprobs'",
    ]
    assert server_differences(INFO, None) == ["/server_info (VLLM_SERVER_DEV_MODE=1)"]


def test_the_cap_scales_with_the_workers_servers():
    assert rescaled_cap(40, 2, 1, 512) == 20 and rescaled_cap(20, 1, 3, 512) == 60
    assert rescaled_cap(20, 1, 3, 50) == 50, "never above max_concurrent_rollouts"
    assert rescaled_cap(1, 3, 1, 512) == 1, "never below one"
    assert rescaled_cap(40, 2, 0, 512) == 40 and rescaled_cap(40, 0, 2, 512) == 40, "no server: kept"


def test_a_failed_server_is_avoided_until_admitted_again():
    servers = ServerSet([A, B])
    servers.mark_down(A)
    assert [servers.pick() for _ in range(3)] == [B] * 3
    servers.update([A, B], {A: 0, B: 0})
    assert servers.usable() == [B], "the same admission: still down"
    servers.update([A, B], {A: 1, B: 0})
    assert servers.usable() == [A, B]


def test_requests_in_flight_on_a_server_taken_out_of_the_run_go_to_another():
    """A server on a dead node never answers: once the trainer takes it out, the request waiting on
    it is cancelled and sent to a server that is left."""
    seen: list[str] = []

    def handler(name: str, hang: bool):
        async def answer(request: web.Request) -> web.Response:
            seen.append(f"{name} {request.path}")
            if hang:
                await asyncio.sleep(3600)
            return web.Response(body=json.dumps(GOOD_BODY), content_type="application/json")

        return answer

    async def scenario():
        (runner_a, url_a), (runner_b, url_b) = (
            await serve(handler("a", True)),
            await serve(handler("b", False)),
        )
        try:
            async with VLLMClient([url_a, url_b], timeout=30, model="m") as client:
                request = asyncio.create_task(client.complete([1], SAMPLING, seed=0))  # ties: A first
                await asyncio.wait_for(until(lambda: seen), 30)  # the request waits on A
                client.set_servers([url_b], {url_a: 0, url_b: 0})
                completion = await asyncio.wait_for(request, 30)
                return completion.server_url, url_b, client.moved_count
        finally:
            await runner_a.cleanup()
            await runner_b.cleanup()

    answered_by, url_b, moved = asyncio.run(scenario())
    # Then B is asked which weights it runs: this route does not say, and the request had to move.
    assert seen == ["a /v1/completions", "b /v1/completions", "b /weight_info"]
    assert answered_by == url_b and moved == 1


def test_a_real_cancellation_is_not_taken_for_a_server_leaving():
    async def scenario():
        async def hang(request: web.Request) -> web.Response:
            await asyncio.sleep(3600)
            return web.Response()

        runner, url = await serve(hang)
        try:
            async with VLLMClient(url, timeout=30, model="m") as client:
                request = asyncio.create_task(client.complete([1], SAMPLING, seed=0))
                await asyncio.sleep(0.2)
                request.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await request
                return client.moved_count
        finally:
            await runner.cleanup()

    assert asyncio.run(scenario()) == 0


def test_the_server_settings_are_checked_when_the_config_is_built(tmp_path):
    with pytest.raises(ValueError, match="vllm_server_base_url is empty"):
        AsyncGRPOConfig(output_dir=str(tmp_path), vllm_server_base_url="", report_to="none")
    listed = AsyncGRPOConfig(
        output_dir=str(tmp_path),
        vllm_server_base_url="",
        vllm_server_urls_file="servers.txt",
        report_to="none",
    )
    assert listed.vllm_server_urls == [] and listed.max_lost_server_fraction == 1.0
    with pytest.raises(ValueError, match=r"max_lost_server_fraction=0 must be in \(0, 1\]"):
        AsyncGRPOConfig(output_dir=str(tmp_path), max_lost_server_fraction=0, report_to="none")
