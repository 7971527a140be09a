"""The async HTTP client for vLLM servers, used by the rollout worker and the trainer.

Token ids in, token ids and log-probs out: the trainer never re-tokenizes what the sampler produced.
Every sampling field is sent explicitly (an unset one would fall back to the model's
generation_config), and every request carries its own seed so that data-parallel engines never
return the same sample twice.

Failure policy: connection errors and 5xx answers are transient (a server restarting, a proxy
timing out) and retried with bounded exponential backoff, each retry counted
(`rollout/vllm_retry_count`); a 4xx is the caller's mistake and fails at once, quoting the server.
Nothing waits longer than `timeout` seconds: a generation request that times out is retried a few
times, everything else raises.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from asyncgrpo.generation.responses import Completion, parse_completion_response, parse_generate_response
from asyncgrpo.generation.server_auth import auth_headers, unauthorized_message
from asyncgrpo.generation.server_info import ServerInfo, parse_server_info
from asyncgrpo.generation.server_load import ServerLoad, parse_server_load
from asyncgrpo.generation.vllm_worker_extension import RELOAD_METHOD, WORKER_EXTENSION

logger = logging.getLogger(__name__)

_json_encoder = msgspec.json.Encoder()
RETRY_WARNING_INTERVAL_S = 10.0
# 5xx answers that no retry will fix: the engine process is gone.
_DEAD_ENGINE_MARKERS = ("EngineDeadError", "EngineCore encountered an issue", "Engine loop is not running")
_json_decoder = msgspec.json.Decoder()


class VLLMError(RuntimeError):
    """A vLLM server could not do what was asked."""


class VLLMRequestError(VLLMError):
    """The server rejected a request (4xx): retrying would not help."""

    def __init__(self, url: str, status: int, server_message: str):
        self.url, self.status, self.server_message = url, status, server_message
        super().__init__(f"vLLM server rejected {url} with HTTP {status}: {server_message}")


class VLLMUnavailableError(VLLMError):
    """The server did not answer usefully within the time allowed."""


class VLLMAuthenticationError(VLLMError):
    """The server wants an API key this client does not send (HTTP 401). Not a `VLLMRequestError`:
    callers that read a 4xx as "route missing" must not take a refused key for that."""


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


async def _all_finished(calls) -> list[Any]:
    """Await the calls together; every one runs to its end even when another fails (a failed pause
    must not leave the other servers un-resumed), and the first error is raised after all finished."""
    answers = await asyncio.gather(*calls, return_exceptions=True)
    for answer in answers:
        if isinstance(answer, BaseException):
            raise answer
    return list(answers)


def serve_hint(url: str) -> str:
    port = url.rstrip("/").rsplit(":", 1)[-1] if url.count(":") >= 2 else "8000"
    return (
        f"start one with `asyncgrpo serve MODEL --port {port}` (or `vllm serve MODEL` with the flags in the "
        "README)"
    )


class VLLMClient:
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
            raise ValueError("VLLMClient needs at least one server URL")
        self.base_urls = [url.rstrip("/") for url in urls]
        self.timeout = float(timeout)
        self.model = model
        self.generation_timeout_retries = generation_timeout_retries
        self.request_timeout = request_timeout  # per generation request; None: `timeout`
        self.retry_count = 0
        self._in_flight = dict.fromkeys(self.base_urls, 0)
        self._tie_breaker = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._reload_methods: dict[str, str] = {}  # url -> the collective_rpc method that reloads

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
        unreachable: list[str] | None = None,
    ) -> bytes:
        """One HTTP call with the retry policy of this module; returns the body of a 2xx.

        `retry=False` is for calls that must not be repeated (joining a collective, receiving a
        broadcast): any failure raises at once. `retry_server_errors=False` still waits out an
        unreachable server but takes a 5xx answer as final (a reload the server rejects is not
        going to succeed on the next try). Each connection failure that was retried is appended to
        `unreachable` when given: the server answering afterwards may be a restarted one."""
        url = base_url + path
        budget = self.timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        body = None if payload is None else _json_encoder.encode(payload)
        headers = {"Content-Type": "application/json"} if body is not None else None
        backoff, timeouts_left = 0.25, timeout_retries
        last_warning = loop.time()
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
                    message = _server_message(data)
                    if response.status == 401:
                        raise VLLMAuthenticationError(unauthorized_message(base_url))
                    if response.status < 500:
                        raise VLLMRequestError(url, response.status, message)
                    if any(marker in message for marker in _DEAD_ENGINE_MARKERS):
                        raise VLLMUnavailableError(
                            f"the vLLM engine behind {url} has died and will not recover: {message} "
                            "(its log has the cause); restart the server"
                        )
                    if not retry_server_errors:
                        raise VLLMRequestError(url, response.status, message)
                    error: str = f"HTTP {response.status}: {message}"
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                error = f"{type(exc).__name__}: {exc}"
                if unreachable is not None:
                    unreachable.append(error)
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

    async def _on_all(self, method: str, path: str, payload: Any = None, **kwargs) -> list[Any]:
        """The same call on every server at once (pause, reload, metrics...). Every server's call
        runs to its end even when another's fails (a failed pause must not leave the others
        un-resumed); the first error is raised after all have finished."""
        return await _all_finished(self._json(method, url, path, payload, **kwargs) for url in self.base_urls)

    def _least_busy(self) -> str:
        if len(self.base_urls) == 1:
            return self.base_urls[0]
        lowest = min(self._in_flight.values())
        candidates = [url for url, count in self._in_flight.items() if count == lowest]
        return candidates[next(self._tie_breaker) % len(candidates)]

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

    async def models(self) -> list[dict[str, Any]]:
        return (await self._json("GET", self.base_urls[0], "/v1/models"))["data"]

    async def model_name(self) -> str:
        if self.model is None:
            self.model = (await self.models())[0]["id"]
        return self.model

    async def max_model_len(self) -> int:
        """The smallest `max_model_len` over the servers: a request must fit on any of them."""
        answers = await self._on_all("GET", "/v1/models")
        return min(int(answer["data"][0]["max_model_len"]) for answer in answers)

    async def weight_labels(self, urls: list[str] | None = None) -> list[str]:
        """Each server's weight-version label (`GET /weight_info`), in `base_urls` order (or `urls`')."""
        answers = await asyncio.gather(
            *(self._json("GET", url, "/weight_info") for url in urls or self.base_urls)
        )
        return [str(answer.get("weight_version")) for answer in answers]

    async def version(self) -> str:
        return (await self._json("GET", self.base_urls[0], "/version"))["version"]

    async def server_info(self) -> ServerInfo | None:
        """What the first server was started with (`/server_info`, dev mode); None when it does
        not say. Every server of a run is expected to be started alike."""
        try:
            answer = await self._json(
                "GET", self.base_urls[0], "/server_info", params={"config_format": "json"}
            )
        except VLLMRequestError:
            return None
        return parse_server_info(answer if isinstance(answer, dict) else None)

    async def world_sizes(self) -> list[int]:
        """Worker processes (TP x PP x DP) of each server, in `base_urls` order."""
        return [int(answer["world_size"]) for answer in await self._on_all("GET", "/get_world_size")]

    async def supports_token_generate(self) -> bool:
        """Whether `/inference/v1/generate` is enabled (`--enable-scale-out`) on every server."""
        for url in self.base_urls:
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
        _, body = await self._generation_call("/inference/v1/generate", payload, cache_salt)
        return parse_generate_response(body, sampling.num_top_logprobs)

    async def _generation_call(
        self, path: str, payload: dict[str, Any], cache_salt: str | None, unreachable: list[str] | None = None
    ) -> tuple[str, bytes]:
        """(the server that answered, its answer)."""
        if cache_salt is not None:  # both generation routes take it at the top level
            payload["cache_salt"] = cache_salt
        url = self._least_busy()
        self._in_flight[url] += 1
        try:
            body = await self._request(
                "POST", url, path, payload, timeout_retries=self.generation_timeout_retries,
                timeout=self.request_timeout, unreachable=unreachable,
            )  # fmt: skip
            return url, body
        finally:
            self._in_flight[url] -= 1

    # -- load --------------------------------------------------------------------------------------

    async def load(self) -> ServerLoad | None:
        """The servers' combined load from `/metrics`; None when a server has no usable metrics."""
        try:
            texts = await asyncio.gather(
                *(
                    self._request("GET", url, "/metrics", timeout=min(self.timeout, 30.0))
                    for url in self.base_urls
                )
            )
            return ServerLoad.combine([parse_server_load(text.decode()) for text in texts])
        except (VLLMRequestError, ValueError):
            return None

    # -- control (dev mode: VLLM_SERVER_DEV_MODE=1) --------------------------------------------------

    async def pause(
        self, mode: str = "keep", clear_cache: bool = False, timeout: float | None = None
    ) -> None:
        """Stop scheduling. `keep` freezes running requests (they continue on resume), `wait`
        lets them finish first, `abort` ends them. `clear_cache=True` also empties the KV and
        prefix caches, which under `keep` preempts every frozen request: on resume each one
        recomputes its whole KV. The trainer does not need that: requests carry their policy
        version as `cache_salt` (see `policy_cache_salt`), so no request reuses a prefix computed
        by older weights than its own version's."""
        clear = "true" if clear_cache else "false"
        await self._on_all("POST", "/pause", params={"mode": mode, "clear_cache": clear}, timeout=timeout)

    async def resume(self, timeout: float | None = None) -> None:
        await self._on_all("POST", "/resume", timeout=timeout)

    async def is_paused(self) -> bool:
        return all(answer["is_paused"] for answer in await self._on_all("GET", "/is_paused"))

    async def reset_prefix_cache(self) -> None:
        await self._on_all("POST", "/reset_prefix_cache")

    async def set_weight_label(self, label: str) -> None:
        """Label the weights every server runs (what `weight_labels` reports) without loading any."""
        await self._on_all("POST", "/update_weight_version", {"new_version": label})

    async def reload_weights(
        self, weights_dir: str, version: str | None = None, timeout: float | None = None
    ) -> None:
        """Load new weights from a directory of safetensors (HF names) on every server. Prefix-cache
        entries of the old weights stay, under their own `cache_salt`; callers that send no salt
        must `reset_prefix_cache` (it succeeds only once no request holds blocks). A server started
        with asyncgrpo's worker extension reloads through it (`_reload_method`)."""

        async def reload(url: str) -> Any:
            method = await self._reload_method(url)
            payload = {"method": method, "kwargs": {"weights_path": str(weights_dir)}}
            return await self._json(
                "POST", url, "/collective_rpc", payload, retry_server_errors=False, timeout=timeout
            )

        calls = [_all_finished(reload(url) for url in self.base_urls)]
        if version is not None:  # only a label: set it alongside, not after, while the servers wait
            calls.append(
                self._on_all("POST", "/update_weight_version", {"new_version": version}, timeout=timeout)
            )
        await asyncio.gather(*calls)

    async def _reload_method(self, url: str) -> str:
        """vLLM's `reload_weights`, or the worker extension's reload on a server started with it (it
        repacks fused-MoE weights that vLLM's own reload leaves unpacked on CPU). Read once per server
        from `/server_info`: the extension is a start-up flag."""
        if url not in self._reload_methods:
            try:
                answer = await self._json("GET", url, "/server_info", params={"config_format": "json"})
            except VLLMRequestError:
                answer = None
            info = parse_server_info(answer if isinstance(answer, dict) else None)
            extended = info is not None and info.worker_extension == WORKER_EXTENSION
            self._reload_methods[url] = RELOAD_METHOD if extended else "reload_weights"
        return self._reload_methods[url]

    # -- native weight transfer (`--weight-transfer-config`): never retried, each call joins a
    # collective or a protocol step that must happen exactly once --------------------------------

    async def init_weight_transfer_engine(self, init_infos: list[dict[str, Any]]) -> None:
        """Join every server's workers to the transfer group (one `init_info` per server, in
        `base_urls` order). Blocks until the whole group has joined, the trainer included."""
        await asyncio.gather(
            *(
                self._request("POST", url, "/init_weight_transfer_engine", {"init_info": info}, retry=False)
                for url, info in zip(self.base_urls, init_infos, strict=True)
            )
        )

    async def start_weight_update(self) -> None:
        await self._on_all("POST", "/start_weight_update", retry=False)

    async def update_weights(self, update_info: dict[str, Any], timeout: float | None = None) -> None:
        """Receive the broadcast described by `update_info` (names, dtype_names, shapes); returns
        when the servers have loaded every tensor, so the trainer must broadcast meanwhile."""
        await self._on_all(
            "POST", "/update_weights", {"update_info": update_info}, retry=False, timeout=timeout
        )

    async def finish_weight_update(self, version: str, timeout: float | None = None) -> None:
        await self._on_all(
            "POST", "/finish_weight_update", {"weight_version": version}, retry=False, timeout=timeout
        )

    async def shutdown_weight_transfer_engine(self, timeout: float | None = None) -> None:
        await self._on_all("POST", "/shutdown_weight_transfer_engine", retry=False, timeout=timeout)

    async def load_lora_adapter(self, name: str, path: str, load_inplace: bool = False) -> None:
        """Load an adapter from `path` (readable by the servers) as model `name`; `load_inplace`
        replaces one already loaded under that name (and loads it where it is not)."""
        payload = {"lora_name": name, "lora_path": str(path), "load_inplace": load_inplace}
        await self._on_all("POST", "/v1/load_lora_adapter", payload)

    async def unload_lora_adapter(self, name: str) -> None:
        await self._on_all("POST", "/v1/unload_lora_adapter", {"lora_name": name})


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
