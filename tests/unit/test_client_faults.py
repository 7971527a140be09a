"""The client's failure policy, against a tiny local HTTP server that misbehaves on purpose, and how it
asks each server to reload weights."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

from aiohttp import web  # noqa: E402

from asyncgrpo.generation.client import SamplingParams, VLLMClient, VLLMRequestError, VLLMUnavailableError  # noqa: E402
from asyncgrpo.generation.vllm_worker_extension import RELOAD_METHOD, WORKER_EXTENSION  # noqa: E402

SAMPLING = SamplingParams(max_tokens=2)
GOOD_BODY = {
    "choices": [
        {
            "token_ids": [5, 6],
            "logprobs": {"token_logprobs": [-0.5, -0.25], "top_logprobs": None},
            "finish_reason": "length",
        }
    ]
}


async def serve(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def scripted(statuses: list[int]):
    """A handler answering with the given statuses in turn, then 200 with a good completion."""
    calls = []

    async def handler(request: web.Request) -> web.Response:
        calls.append(request.path)
        if len(calls) <= len(statuses):
            status = statuses[len(calls) - 1]
            return web.json_response({"error": {"message": f"scripted {status}"}}, status=status)
        return web.json_response(GOOD_BODY)

    return handler, calls


def test_5xx_and_503_are_retried_then_succeed():
    async def scenario():
        handler, calls = scripted([500, 503])
        runner, url = await serve(handler)
        try:
            async with VLLMClient(url, timeout=10, model="m") as client:
                completion = await client.complete([1, 2], SAMPLING, seed=0)
                return completion, client.retry_count, len(calls)
        finally:
            await runner.cleanup()

    completion, retries, calls = asyncio.run(scenario())
    assert completion.token_ids.tolist() == [5, 6]
    assert retries == 2 and calls == 3


def test_4xx_fails_at_once_quoting_the_server():
    async def scenario():
        handler, calls = scripted([400, 400, 400])
        runner, url = await serve(handler)
        try:
            async with VLLMClient(url, timeout=10, model="m") as client:
                with pytest.raises(VLLMRequestError) as error:
                    await client.complete([1, 2], SAMPLING, seed=0)
                return error.value, client.retry_count, len(calls)
        finally:
            await runner.cleanup()

    error, retries, calls = asyncio.run(scenario())
    assert error.status == 400 and "scripted 400" in str(error)
    assert retries == 0 and calls == 1


def test_a_server_that_never_answers_times_out_within_the_bound():
    # Counted, not timed: a generation request is tried twice (one retry on timeout), a control
    # request once (a weight sync's call then skips the server and names it); each attempt waits out
    # the 1 s timeout. The upper bounds only tell a bounded wait
    # from a hang (the server sleeps for an hour), so a loaded machine cannot fail them.
    attempts: list[str] = []

    async def never(request: web.Request) -> web.Response:
        attempts.append(request.path)
        await asyncio.sleep(3600)
        return web.Response()

    async def scenario():
        runner, url = await serve(never)
        try:
            async with VLLMClient(url, timeout=1.0, model="m", generation_timeout_retries=1) as client:
                started = time.monotonic()
                with pytest.raises(VLLMUnavailableError) as error:
                    await client.complete([1, 2], SAMPLING, seed=0)
                generation_elapsed = time.monotonic() - started
                generation_attempts = len(attempts)
                started = time.monotonic()
                assert await client.pause() == [url]
                control_elapsed = time.monotonic() - started
                return (
                    error.value,
                    generation_elapsed,
                    generation_attempts,
                    control_elapsed,
                    client.retry_count,
                )
        finally:
            await runner.cleanup()

    error, generation_elapsed, generation_attempts, control_elapsed, retries = asyncio.run(scenario())
    assert generation_attempts == 2 and retries == 1 and attempts[2:] == ["/pause"]
    assert 2.0 <= generation_elapsed < 60 and 1.0 <= control_elapsed < 60
    assert "did not answer within 1 s" in str(error)


def test_an_unreachable_url_at_start_up_fails_in_time_naming_url_and_command():
    async def scenario():
        async with VLLMClient("http://127.0.0.1:9", timeout=2.0) as client:
            started = time.monotonic()
            with pytest.raises(VLLMUnavailableError) as error:
                await client.wait_until_ready()
            return error.value, time.monotonic() - started

    error, elapsed = asyncio.run(scenario())
    assert elapsed < 60  # the 2 s start-up timeout, not a wait without end
    assert "http://127.0.0.1:9" in str(error) and "asyncgrpo serve" in str(error)


def test_requests_spread_over_servers_by_least_in_flight():
    async def scenario():
        seen: list[str] = []

        def slow_handler(name: str):
            async def handler(request: web.Request) -> web.Response:
                seen.append(name)
                await asyncio.sleep(0.2)
                return web.Response(body=json.dumps(GOOD_BODY), content_type="application/json")

            return handler

        runner_a, url_a = await serve(slow_handler("a"))
        runner_b, url_b = await serve(slow_handler("b"))
        try:
            async with VLLMClient([url_a, url_b], timeout=10, model="m") as client:
                await asyncio.gather(*(client.complete([1], SAMPLING, seed=s) for s in range(10)))
        finally:
            await runner_a.cleanup()
            await runner_b.cleanup()
        return seen

    seen = asyncio.run(scenario())
    assert seen.count("a") == 5 and seen.count("b") == 5


def test_a_dead_engine_is_left_at_once_for_another_server_and_named_when_none_is_left():
    """A dead engine's answer is final: the request goes to another server at once (counted), and
    with none left it waits for one within the timeout, then says why. The dead server is asked
    once, not retried for the whole timeout."""
    dead_calls = []

    async def dead(request: web.Request) -> web.Response:
        dead_calls.append(request.path)
        message = "EngineCore encountered an issue. See stack trace (above) for the root cause."
        return web.json_response({"error": {"message": message, "type": "EngineDeadError"}}, status=500)

    async def good(request: web.Request) -> web.Response:
        return web.json_response(GOOD_BODY)

    async def scenario():
        (runner_dead, url_dead), (runner_good, url_good) = await serve(dead), await serve(good)
        try:
            async with VLLMClient([url_dead, url_good], timeout=60, model="m") as client:
                completion = await client.complete([1, 2], SAMPLING, seed=0)  # ties go in turn: dead first
                moved = client.moved_count
            async with VLLMClient(url_dead, timeout=2, model="m") as alone:
                started = time.monotonic()
                with pytest.raises(VLLMUnavailableError, match="has died and will not recover"):
                    await alone.complete([1, 2], SAMPLING, seed=0)
                return completion, url_good, moved, time.monotonic() - started
        finally:
            await runner_dead.cleanup()
            await runner_good.cleanup()

    completion, url_good, moved, alone_s = asyncio.run(scenario())
    assert completion.token_ids.tolist() == [5, 6] and completion.server_url == url_good
    assert moved == 1 and dead_calls == ["/v1/completions"] * 2  # once per client: never retried
    assert alone_s < 30  # the 2 s the lone client waits for another server, not a wait without end


def test_a_server_with_the_worker_extension_reloads_through_it():
    """Each server is asked for /server_info once; the one started with asyncgrpo's worker extension
    reloads through the extension's method (it repacks fused-MoE weights), the other through vLLM's."""

    def fake_server(extension: str):
        calls = []

        async def handler(request: web.Request) -> web.Response:
            if request.path == "/server_info":
                calls.append("server_info")
                config = {
                    "parallel_config": {"worker_extension_cls": extension},
                    "device_config": {"device": "cpu"},
                }
                return web.json_response({"vllm_config": config})
            if request.path == "/collective_rpc":
                body = await request.json()
                calls.append((body["method"], body["kwargs"]["weights_path"]))
            return web.json_response({})

        return handler, calls

    async def scenario():
        (with_handler, with_calls), (without_handler, without_calls) = (
            fake_server(WORKER_EXTENSION),
            fake_server(""),
        )
        runner_a, url_a = await serve(with_handler)
        runner_b, url_b = await serve(without_handler)
        try:
            async with VLLMClient([url_a, url_b], timeout=10, model="m") as client:
                await client.reload_weights("/weights/v1", version="1")
                await client.reload_weights("/weights/v2")
        finally:
            await runner_a.cleanup()
            await runner_b.cleanup()
        return with_calls, without_calls

    with_calls, without_calls = asyncio.run(scenario())
    assert with_calls == ["server_info", (RELOAD_METHOD, "/weights/v1"), (RELOAD_METHOD, "/weights/v2")]
    assert without_calls == [
        "server_info",
        ("reload_weights", "/weights/v1"),
        ("reload_weights", "/weights/v2"),
    ]
