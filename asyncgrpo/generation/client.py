"""The async HTTP client for vLLM servers, used by the rollout worker and the trainer.

Token ids in, token ids and log-probs out: the trainer never re-tokenizes what the sampler produced.
Every sampling field is sent explicitly (an unset one would fall back to the model's
generation_config), and every request carries its own seed so that data-parallel engines never
return the same sample twice.

Failure policy: connection errors and 5xx answers are transient (a server restarting, a proxy
timing out) and retried with bounded exponential backoff, each retry counted
(`rollout/vllm_retry_count`); a 4xx is the caller's mistake and fails at once, quoting the server.
Nothing waits longer than `timeout` seconds: a generation request that times out is retried a few
times, everything else raises. With several servers, a server that refuses or drops a connection is
lost for the request, which goes to another one at once (generation/server_set.py); a weight sync's
calls skip a server they cannot reach and say which (the trainer then counts it lost).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.generation.control import UNREACHABLE_AFTER_S, ServerControl, _all_finished
from asyncgrpo.generation.errors import (
    ServerLostError,
    VLLMAuthenticationError,
    VLLMError,
    VLLMRequestError,
    VLLMServerLostError,
    VLLMUnavailableError,
)
from asyncgrpo.generation.responses import Completion, parse_completion_response, parse_generate_response
from asyncgrpo.generation.server_auth import auth_headers, unauthorized_message
from asyncgrpo.generation.server_info import ServerInfo, parse_server_info
from asyncgrpo.generation.server_load import ServerLoad, parse_server_load
from asyncgrpo.generation.server_set import RETRY_DOWN_AFTER_S, ServerSet

logger = logging.getLogger(__name__)

_json_encoder = msgspec.json.Encoder()
RETRY_WARNING_INTERVAL_S = 10.0
# 5xx answers that no retry will fix: the engine process is gone.
_DEAD_ENGINE_MARKERS = ("EngineDeadError", "EngineCore encountered an issue", "Engine loop is not running")
_json_decoder = msgspec.json.Decoder()


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one generation request. All are sent, none left to server defaults."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filtering
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    num_top_logprobs: int = 0  # the sampler's top-N log-probs per token (score centering)
    stop_token_ids: tuple[int, ...] = ()
    # Tokens generated before EOS or a stop token may end the request: a request that must stay in
    # flight for a while (a pause test, a load test) sets it, training requests leave it at 0.
    min_tokens: int = 0

    def as_request_fields(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "min_tokens": self.min_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "stop_token_ids": list(self.stop_token_ids),
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "include_stop_str_in_output": True,
            "ignore_eos": False,
            "n": 1,
        }


POLICY_LABEL_PREFIX = "asyncgrpo-policy-"


def policy_label(version: int) -> str:
    """The weight-version label the trainer gives the servers with policy `version`. A server that
    reports any other label (vLLM's own is "default") runs weights the trainer did not push: it was
    restarted and serves its original checkpoint."""
    return f"{POLICY_LABEL_PREFIX}{version}"


def parse_policy_label(label: str | None) -> int | None:
    """The policy version of a label `policy_label` made; None for any other label."""
    if not label or not label.startswith(POLICY_LABEL_PREFIX):
        return None
    try:
        return int(label[len(POLICY_LABEL_PREFIX) :])
    except ValueError:
        return None


def policy_adapter_name(prefix: str, version: int) -> str:
    """The name policy `version`'s LoRA adapter is served under (adapter-only weight sync)."""
    return f"{prefix}-v{version}"


def policy_cache_salt(version: int) -> str:
    """The `cache_salt` of a request sent under policy `version`. vLLM keys prefix-cache blocks by
    it, so after a weight sync new requests never reuse KV computed by older weights, and nothing
    needs the prefix cache emptied while frozen requests still hold blocks."""
    return f"asyncgrpo-policy-{version}"


def serve_hint(url: str) -> str:
    port = url.rstrip("/").rsplit(":", 1)[-1] if url.count(":") >= 2 else "8000"
    return (
        f"start one with `asyncgrpo serve MODEL --port {port}` (or `vllm serve MODEL` with the flags in the "
        "README)"
    )


class VLLMClient(ServerControl):
    """Talks to one or more vLLM servers (`base_urls`); generation goes to the least busy one.

    Create it anywhere, use it inside one event loop: the HTTP session is opened on first use in
    the running loop and closed by `close()` (or `async with`).
    """

    def __init__(
        self,
        base_urls: str | list[str],
        timeout: float = 1800.0,
        model: str | None = None,
        generation_timeout_retries: int = 3,
        request_timeout: float | None = None,
    ):
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ConfigurationError("VLLMClient needs at least one server URL")
        self.servers = ServerSet([url.rstrip("/") for url in urls])
        self.timeout = float(timeout)
        self.model = model
        self.generation_timeout_retries = generation_timeout_retries
        self.request_timeout = request_timeout  # per generation request; None: `timeout`
        self.retry_count = 0
        self.moved_count = 0  # generation requests sent again to another server: theirs was lost
        self._last_move_warning = float("-inf")
        self._session: aiohttp.ClientSession | None = None
        self._reload_methods: dict[str, str] = {}  # url -> the collective_rpc method that reloads

    @property
    def base_urls(self) -> list[str]:
        """The servers this client uses: generation goes to the least busy, control calls to all."""
        return self.servers.urls

    def set_servers(self, urls: list[str], admissions: dict[str, int], live: list[str] | None = None) -> None:
        """The trainer's choice of servers (generation/server_set.py); requests in flight on a server
        that left `live` go to another one."""
        self.servers.update([url.rstrip("/") for url in urls], admissions, live)

    def mark_down(self, url: str | None) -> None:
        """Avoid `url` (it failed, or runs weights the trainer did not push) until the trainer admits
        it again, or RETRY_DOWN_AFTER_S has passed."""
        if url is not None:
            self.servers.mark_down(url)

    async def __aenter__(self) -> "VLLMClient":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No connection cap here: the rollout worker's own concurrency limits govern.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), headers=auth_headers()
            )
        return self._session

    # -- transport -----------------------------------------------------------------------------

    async def _request(
        self,
        method: str,
        base_url: str,
        path: str,
        payload: Any = None,
        params: dict[str, str] | None = None,
        timeout_retries: int = 0,
        timeout: float | None = None,
        retry: bool = True,
        retry_server_errors: bool = True,
        unreachable_after: float | None = None,
    ) -> bytes:
        """One HTTP call with the retry policy of this module; returns the body of a 2xx.

        `retry=False` is for calls that must not be repeated (joining a collective, receiving a
        broadcast): any failure raises at once. `retry_server_errors=False` still waits out an
        unreachable server but takes a 5xx answer as final (a reload the server rejects is not
        going to succeed on the next try). `unreachable_after`: connection failures are retried
        for that many seconds at most, then ServerLostError says the server is gone (None:
        until the deadline, as any failure)."""
        url = base_url + path
        budget = self.timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        body = None if payload is None else _json_encoder.encode(payload)
        headers = {"Content-Type": "application/json"} if body is not None else None
        backoff, timeouts_left = 0.25, timeout_retries
        last_warning = loop.time()
        lost_since: float | None = None  # the first connection failure
        while True:
            attempt_budget = max(deadline - loop.time(), 0.001) if timeout_retries == 0 else budget
            try:
                async with self._http().request(
                    method,
                    url,
                    data=body,
                    params=params,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=attempt_budget),
                ) as response:
                    data = await response.read()
                    if response.status < 400:
                        return data
                    error: str = _failed_answer(url, base_url, response.status, data, retry_server_errors)
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                error = f"{type(exc).__name__}: {exc}"
                if unreachable_after is not None:
                    lost_since = loop.time() if lost_since is None else lost_since
                    if loop.time() - lost_since >= unreachable_after:
                        raise ServerLostError(f"vLLM server {url} is unreachable: {error}", base_url)
            except asyncio.TimeoutError:
                if timeouts_left <= 0 or not retry:
                    raise VLLMUnavailableError(
                        f"vLLM server {url} did not answer within {budget:.0f} s "
                        "(vllm_server_timeout, request_timeout, "
                        "weight_sync_timeout)"
                    ) from None
                timeouts_left -= 1
                deadline = loop.time() + budget
                error = "timed out"
            if not retry:
                raise VLLMUnavailableError(f"vLLM server {url} failed: {error}")
            self.retry_count += 1
            if loop.time() - last_warning > RETRY_WARNING_INTERVAL_S:
                last_warning = loop.time()
                logger.warning(
                    "vLLM server %s: %s; retrying for up to %.0f s more", url, error, deadline - loop.time()
                )
            if loop.time() + backoff > deadline:
                raise VLLMUnavailableError(
                    f"vLLM server {url} kept failing for {budget:.0f} s (last error: {error}); "
                    f"is it running? {serve_hint(base_url)}"
                )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _json(self, method: str, base_url: str, path: str, payload: Any = None, **kwargs) -> Any:
        data = await self._request(method, base_url, path, payload, **kwargs)
        if not data:
            return None
        try:
            return _json_decoder.decode(data)
        except msgspec.DecodeError:  # some control endpoints answer plain text
            return data.decode(errors="replace")

    async def _on_all(
        self, method: str, path: str, payload: Any = None, urls: list[str] | None = None, **kwargs
    ) -> list[Any]:
        """The same call on every server (`urls`, default all) at once. Every server's call runs to
        its end even when another's fails (a failed pause must not leave the others un-resumed); the
        first error is raised after all have finished."""
        targets = self.base_urls if urls is None else urls
        return await _all_finished(self._json(method, url, path, payload, **kwargs) for url in targets)

    # -- start-up and capabilities ---------------------------------------------------------------

    async def wait_until_ready(self, timeout: float | None = None) -> None:
        """Poll every server's `/v1/models` until it answers; fail naming the URL that did not."""
        budget = self.timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        for url in self.base_urls:
            last_error = "no answer"
            while True:
                try:
                    async with self._http().get(
                        url + "/v1/models",
                        timeout=aiohttp.ClientTimeout(total=max(deadline - loop.time(), 0.1)),
                    ) as response:
                        if response.status == 200:
                            break
                        if response.status == 401:
                            raise VLLMAuthenticationError(unauthorized_message(url))
                        last_error = f"HTTP {response.status}"
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                if loop.time() + 1.0 > deadline:
                    raise VLLMUnavailableError(
                        f"no vLLM server answered at {url} within {budget:.0f} s ({last_error}); "
                        f"{serve_hint(url)}"
                    )
                await asyncio.sleep(1.0)

    async def models(self, url: str | None = None) -> list[dict[str, Any]]:
        return (await self._json("GET", url or self.base_urls[0], "/v1/models"))["data"]

    async def model_name(self) -> str:
        if self.model is None:
            self.model = (await self.models())[0]["id"]
        return self.model

    async def max_model_len(self, urls: list[str] | None = None) -> int:
        """The smallest `max_model_len` over the servers: a request must fit on any of them."""
        answers = await self._on_all("GET", "/v1/models", urls=urls)
        return min(int(answer["data"][0]["max_model_len"]) for answer in answers)

    async def weight_labels(self, urls: list[str] | None = None) -> list[str]:
        """Each server's weight-version label (`GET /weight_info`), in `base_urls` order (or `urls`')."""
        answers = await asyncio.gather(
            *(self._json("GET", url, "/weight_info") for url in urls or self.base_urls)
        )
        return [str(answer.get("weight_version")) for answer in answers]

    async def probe(self, url: str, timeout: float) -> str:
        """Whether a server serves (`/health`: a dead engine fails it) and which weights it runs (its
        weight-version label), asked once: no retry, each call within `timeout` seconds (the
        trainer's watch over its servers, trainer/server_roster.py). Raises VLLMError."""
        await self._request("GET", url, "/health", retry=False, timeout=timeout)
        answer = await self._json("GET", url, "/weight_info", retry=False, timeout=timeout)
        return str(answer.get("weight_version"))

    async def version(self) -> str:
        return (await self._json("GET", self.base_urls[0], "/version"))["version"]

    async def server_info(self, url: str | None = None) -> ServerInfo | None:
        """What a server (default: the first) was started with (`/server_info`, dev mode); None when
        it does not say. Every server of a run is expected to be started alike (a server joining a
        run is checked against the first: generation/server_info.py, `server_differences`)."""
        try:
            answer = await self._json(
                "GET", url or self.base_urls[0], "/server_info", params={"config_format": "json"}
            )
        except VLLMRequestError:
            return None
        return parse_server_info(answer if isinstance(answer, dict) else None)

    async def world_sizes(self, urls: list[str] | None = None) -> list[int]:
        """Worker processes (TP x PP x DP) of each server, in `base_urls` order (or `urls`')."""
        answers = await self._on_all("GET", "/get_world_size", urls=urls)
        return [int(answer["world_size"]) for answer in answers]

    async def supports_token_generate(self, urls: list[str] | None = None) -> bool:
        """Whether `/inference/v1/generate` is enabled (`--enable-scale-out`) on every server."""
        for url in self.base_urls if urls is None else urls:
            try:
                await self._json("POST", url, "/inference/v1/generate", {"token_ids": []})
            except VLLMRequestError as error:
                # 422/400: the route exists and rejected the empty request; 403/404: no route.
                if error.status in (403, 404):
                    return False
        return True

    async def supports_sampling_mask(self) -> bool:
        """Whether every server reports top-k/top-p candidate sets (`--return-sampling-mask`
        and `--enable-scale-out`)."""
        info = await self.server_info()
        return info is not None and info.return_sampling_mask and await self.supports_token_generate()

    # -- generation --------------------------------------------------------------------------------

    async def complete(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        seed: int,
        model: str | None = None,
        cache_salt: str | None = None,
    ) -> Completion:
        """Sample one continuation through `/v1/completions` (works on every vLLM server).
        `cache_salt`: the request reuses only prefix-cache blocks computed under the same salt."""
        payload = {
            "model": model or await self.model_name(),
            "prompt": prompt_ids,
            "seed": seed,
            "logprobs": sampling.num_top_logprobs,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "echo": False,
            "stream": False,
            **sampling.as_request_fields(),
        }
        unreachable: list[str] = []
        url, body = await self._generation_call("/v1/completions", payload, cache_salt, unreachable)
        completion = parse_completion_response(body, sampling.num_top_logprobs)
        completion.server_url = url
        if unreachable:
            # This route does not say which weights sampled the tokens: after losing the server once,
            # ask which weights it runs now (a restarted server answers with vLLM's own label).
            completion.weight_labels = tuple(await self.weight_labels([url]))
        return completion

    async def generate_tokens(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        seed: int,
        model: str | None = None,
        cache_salt: str | None = None,
    ) -> Completion:
        """Sample one continuation through `/inference/v1/generate` (`--enable-scale-out`): tokens in,
        tokens out, nothing detokenized, which spares the server's API process most of its work
        per token (decoding each top log-prob's token). With each token's candidate set when the
        server records it (top-k/top-p with `--return-sampling-mask`)."""
        fields = sampling.as_request_fields()
        # +1: the server's list starts with the sampled token and is cut to `logprobs` entries.
        top = sampling.num_top_logprobs + 1 if sampling.num_top_logprobs > 0 else 0
        fields.update(seed=seed, logprobs=top, detokenize=False)
        payload = {
            "token_ids": prompt_ids,
            "sampling_params": fields,
            "model": model or await self.model_name(),
        }
        url, body = await self._generation_call("/inference/v1/generate", payload, cache_salt)
        completion = parse_generate_response(body, sampling.num_top_logprobs)
        completion.server_url = url
        return completion

    async def _generation_call(
        self, path: str, payload: dict[str, Any], cache_salt: str | None, unreachable: list[str] | None = None
    ) -> tuple[str, bytes]:
        """(the server that answered, its answer). A server lost under the request (it refused or
        dropped the connection, its engine died, or the trainer took it out of the run) is avoided
        and the request sent again to another one (`moved_count`); with none left it waits for one,
        at most `timeout` seconds from the first failure. Each failure is appended to `unreachable`
        when given: the server answering afterwards may be a restarted one."""
        if cache_salt is not None:  # both generation routes take it at the top level
            payload["cache_salt"] = cache_salt
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        failing_since: float | None = None
        reason = "no server is in the run"
        while True:
            url = self.servers.pick()
            if url is not None:
                # With another server to go to, a failed connection sends the request there at once;
                # alone, the server gets the time to ride out a dropped connection.
                patience = 0.0 if len(self.servers.usable()) > 1 else UNREACHABLE_AFTER_S
                self.servers.started(url, task)
                try:
                    body = await self._request(
                        "POST", url, path, payload, timeout_retries=self.generation_timeout_retries,
                        timeout=self.request_timeout, unreachable_after=patience,
                    )  # fmt: skip
                    return url, body
                except ServerLostError as error:
                    reason = str(error)
                except asyncio.CancelledError:
                    if not self.servers.was_dropped(task) or task.uncancel() > 0:
                        raise  # a real cancellation, not the trainer taking the server out
                    reason = f"vLLM server {url} was taken out of the run"
                finally:
                    self.servers.finished(url, task)
                self._moved(url, reason, unreachable)
            failing_since = loop.time() if failing_since is None else failing_since
            left = failing_since + self.timeout - loop.time()
            if left <= 0:
                hint = serve_hint(self.base_urls[0]) if self.base_urls else "restart the run's servers"
                raise VLLMUnavailableError(
                    f"no vLLM server could take a generation request for {self.timeout:.0f} s (servers: "
                    f"{', '.join(self.base_urls) or 'none left'}; last failure: {reason}); {hint}"
                )
            if url is None:
                await self.servers.wait_for_change(min(left, RETRY_DOWN_AFTER_S))

    def _moved(self, url: str, reason: str, unreachable: list[str] | None) -> None:
        """A request lost its server: count it, avoid the server, warn now and then."""
        self.servers.mark_down(url)
        self.moved_count += 1
        if unreachable is not None:
            unreachable.append(reason)
        now = time.monotonic()
        if now - self._last_move_warning > RETRY_WARNING_INTERVAL_S:
            self._last_move_warning = now
            logger.warning("%s; its requests go to the other servers", reason)

    # -- load --------------------------------------------------------------------------------------

    async def load(self) -> ServerLoad | None:
        """The combined load, from `/metrics`, of the servers that answer (one that does not is
        lost or restarting: skipped); None when one has no usable metrics. Raises
        VLLMUnavailableError when none answers."""
        urls = self.servers.usable()
        texts = await asyncio.gather(
            *(
                self._request("GET", url, "/metrics", timeout=min(self.timeout, 30.0), retry=False)
                for url in urls
            ),
            return_exceptions=True,
        )
        loads = []
        for text in texts:
            if isinstance(text, VLLMRequestError):
                return None
            if isinstance(text, VLLMUnavailableError):
                continue
            if isinstance(text, BaseException):
                raise text
            try:
                loads.append(parse_server_load(text.decode()))
            except ValueError:
                return None
        if not loads:
            raise VLLMUnavailableError(
                f"no vLLM server answered /metrics ({', '.join(urls) or 'none usable'})"
            )
        return ServerLoad.combine(loads)


def _failed_answer(url: str, base_url: str, status: int, data: bytes, retry_server_errors: bool) -> str:
    """What an answer of HTTP 400 or above means: raises when it is final (a refused key, a rejected
    request, an engine that died, a 5xx not to be retried); else the failure's text, to retry."""
    message = _server_message(data)
    if status == 401:
        raise VLLMAuthenticationError(unauthorized_message(base_url))
    if status < 500:
        raise VLLMRequestError(url, status, message)
    if any(marker in message for marker in _DEAD_ENGINE_MARKERS):
        raise ServerLostError(
            f"the vLLM engine behind {url} has died and will not recover: {message} "
            "(its log has the cause); restart the server",
            base_url,
        )
    if not retry_server_errors:
        raise VLLMRequestError(url, status, message)
    return f"HTTP {status}: {message}"


def _server_message(body: bytes) -> str:
    """The human part of an error body: vLLM's `{"error": {"message"}}`, FastAPI's `{"detail"}`."""
    try:
        decoded = _json_decoder.decode(body)
    except msgspec.DecodeError:
        return body.decode(errors="replace").strip()[:2000] or "(empty body)"
    if isinstance(decoded, dict):
        error = decoded.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if error is not None:
            return str(error)
        if "detail" in decoded:
            return str(decoded["detail"])
        if "message" in decoded:
            return str(decoded["message"])
    return str(decoded)[:2000]


__all__ = [  # the errors live in errors.py; callers import them from here, with the client
    "SamplingParams",
    "ServerLostError",
    "VLLMAuthenticationError",
    "VLLMClient",
    "VLLMError",
    "VLLMRequestError",
    "VLLMServerLostError",
    "VLLMUnavailableError",
]
