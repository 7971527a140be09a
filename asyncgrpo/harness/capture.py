"""The capture proxy: an OpenAI chat-completions endpoint on the rollout worker's event loop, in
front of the servers' token route, that records every turn an agent samples.

Each session gets its own API key; a request's key names the session its turn belongs to. The
request's messages and tools are rendered by the chat template (the ids the engine is given are the
ids recorded), sampled through the rollout loop's `generate_one_turn` (the run's sampling settings,
the policy version's cache salt and weight label, the top-N the loss needs), and recorded as a
`TrainingTurn` (OpenEnv's type) at once, so a turn that breaks the contract is known when it happens.
The agent's own sampling fields (temperature, top_p, max_tokens, ...) are ignored: the trainer's
importance ratios hold only for tokens sampled with the run's settings (`max_completion_length`
bounds every turn).

The event loop also carries every other rollout's requests, so it only moves bytes: a body over
`max_request_bytes` is refused with a 413 before it is read, and the CPU work of a request (parsing
its JSON, the chat template and tokenizing, parsing the sampled reply, checking the captured turn)
runs on a small thread pool of its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from asyncgrpo.errors import ConfigurationError, HarnessError
from asyncgrpo.harness.contract import TrainingTrace, TrainingTurn
from asyncgrpo.harness.openai_chat import chat_completion, parse_sampled_turn, template_messages
from asyncgrpo.harness.trace import CaptureContractError, training_turn
from asyncgrpo.rollout.chat import render_prompt_ids
from asyncgrpo.rollout.types import TurnRecord

logger = logging.getLogger(__name__)

# Sampling one turn under the run's settings: the rollout loop's generate_one_turn.
SampleTurn = Callable[[list[int]], Awaitable[TurnRecord]]
# Threads for the requests' CPU work. It holds the GIL (the template is Python, the JSON parser a C call
# that keeps it), so more threads would not add speed; a few let a short request pass a long one.
CPU_THREADS = 4
# The longest path a Unix socket may have (sun_path holds 108 bytes, its end a zero).
SOCKET_PATH_LIMIT = 107


@dataclass
class CapturedSession:
    episode_id: str
    turns: list[TrainingTurn] = field(default_factory=list)
    error: CaptureContractError | None = None  # the first contract violation, raised at fetch
    sampled: int = 0  # turns sampled so far: the next turn's index in its node id


@dataclass(frozen=True)
class CaptureEndpoint:
    """What a session factory needs of the proxy: where it is, what the model is called, and the
    sessions' keys and traces. Passed as `capture=` to a factory that accepts it."""

    base_url: str
    model: str
    proxy: CaptureProxy
    # The same endpoint on a Unix socket (mode 0700 folder): what a sandbox binds in, its only way out.
    unix_socket: str | None = None

    def open_session(self, episode_id: str) -> str:
        """A fresh API key whose requests are recorded as `episode_id`'s turns."""
        return self.proxy.open_session(episode_id)

    def training_trace(self, api_key: str) -> TrainingTrace:
        return self.proxy.training_trace(api_key)

    def close_session(self, api_key: str) -> None:
        self.proxy.close_session(api_key)


class CaptureProxy:
    def __init__(
        self,
        tokenizer,
        sample_turn: SampleTurn,
        model: str,
        chat_template_kwargs: dict | None,
        parse_reasoning: bool,
        max_request_bytes: int,
    ):
        if max_request_bytes < 1:
            raise ConfigurationError(
                f"max_request_bytes={max_request_bytes} must be >= 1 (the largest body accepted)"
            )
        self.tokenizer = tokenizer
        self.sample_turn = sample_turn
        self.model = model
        self.chat_template_kwargs = chat_template_kwargs
        self.parse_reasoning = parse_reasoning
        self.max_request_bytes = max_request_bytes
        self.sessions: dict[str, CapturedSession] = {}
        self._cpu_pool = ThreadPoolExecutor(max_workers=CPU_THREADS, thread_name_prefix="capture-cpu")
        self._runner: web.AppRunner | None = None
        self._socket_dir: Path | None = None
        self.endpoint: CaptureEndpoint | None = None

    async def start(self, host: str = "127.0.0.1") -> CaptureEndpoint:
        """Listen on a free port of `host` (loopback: the agents run on this machine), and on a Unix
        socket in a private folder, which sandboxed agents reach it through (asyncgrpo/sandbox)."""
        app = web.Application(client_max_size=self.max_request_bytes)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self._socket_dir = _socket_folder()
        socket_path = str(self._socket_dir / "proxy.sock")
        await web.UnixSite(self._runner, socket_path).start()
        self.endpoint = CaptureEndpoint(f"http://{host}:{port}/v1", self.model, self, socket_path)
        return self.endpoint

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        self._cpu_pool.shutdown(wait=False, cancel_futures=True)

    # -- sessions (called from the session threads: dict operations only) ----------------------------

    def open_session(self, episode_id: str) -> str:
        key = f"asyncgrpo-{secrets.token_hex(16)}"
        self.sessions[key] = CapturedSession(episode_id)
        return key

    def training_trace(self, api_key: str) -> TrainingTrace:
        session = self.sessions[api_key]
        if session.error is not None:
            raise session.error
        return TrainingTrace(turns=list(session.turns))

    def close_session(self, api_key: str) -> None:
        self.sessions.pop(api_key, None)

    # -- HTTP -------------------------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _chat_completions(self, request: web.Request) -> web.Response:
        key = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        session = self.sessions.get(key)
        if session is None:
            return _error(401, "unknown API key: use the OPENAI_API_KEY your session was started with")
        size = request.content_length
        if size is not None and size > self.max_request_bytes:
            return self._too_large(f"{size} bytes")  # refused unread: aiohttp discards the rest
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:  # a chunked body that grew past the cap
            return self._too_large("more bytes than that")
        loop = asyncio.get_running_loop()
        try:
            body, tools, prompt_ids = await loop.run_in_executor(self._cpu_pool, self._prompt_of, raw)
            turn = await self.sample_turn(prompt_ids)
        except _Refused as refused:
            return _error(refused.status, str(refused))
        except ValueError as error:  # no room left under max_model_len
            return _error(400, str(error))
        node_id = f"{session.episode_id}-{session.sampled}"
        session.sampled += 1
        try:
            response, captured = await loop.run_in_executor(
                self._cpu_pool, self._capture, turn, node_id, body, tools
            )
        except CaptureContractError as error:
            session.error = session.error or error
            return _error(500, str(error))
        session.turns.append(captured)
        return web.json_response(response)

    def _too_large(self, size: str) -> web.Response:
        limit = self.max_request_bytes
        return _error(
            413,
            f"the request body ({size}) is over the capture proxy's limit of {limit} bytes "
            f"(harness_max_request_mb={limit / 2**20:g}): the conversation is too long, a tool output in it "
            "may be; shorten it, or raise the trainer's harness_max_request_mb",
        )

    # -- the CPU work of a request (on the pool) --------------------------------------------------------

    def _prompt_of(self, raw: bytes) -> tuple[dict[str, Any], list | None, list[int]]:
        """The request body, its tools and its prompt ids through the chat template."""
        try:
            body = json.loads(raw)
        except ValueError as error:
            raise _Refused(400, f"the request body is not JSON ({error})") from None
        if not isinstance(body, dict):
            raise _Refused(400, "the request body must be a JSON object (a chat-completions request)")
        if body.get("stream"):
            raise _Refused(400, "streaming is not supported by the capture proxy: send stream=false")
        if body.get("n", 1) != 1:
            raise _Refused(400, "n must be 1: each sampled turn is one rollout step")
        tools = body.get("tools") or None
        try:
            prompt_ids = render_prompt_ids(
                self.tokenizer,
                template_messages(body.get("messages") or []),
                tools,
                self.chat_template_kwargs,
            )
        except Exception as error:  # the template refused the agent's messages: the agent's problem
            raise _Refused(
                400, f"the chat template failed on the messages ({type(error).__name__}: {error})"
            ) from None
        return body, tools, prompt_ids

    def _capture(
        self, turn: TurnRecord, node_id: str, body: dict[str, Any], tools: list | None
    ) -> tuple[dict[str, Any], TrainingTurn]:
        """The reply the agent reads, and the turn as recorded (CaptureContractError if it breaks the
        contract)."""
        parsed = parse_sampled_turn(self.tokenizer, turn, bool(tools), self.parse_reasoning)
        response = chat_completion(parsed, turn, self.model, call_id_prefix=node_id)
        captured = training_turn(turn, node_id, {"messages": body.get("messages"), "tools": tools}, response)
        return response, captured


def _socket_folder() -> Path:
    """A private folder (mode 0700) for the proxy's socket, in the temporary folder unless its path
    would be too long for a socket's (108 bytes on Linux), then in /tmp."""
    folder = Path(tempfile.mkdtemp(prefix="asyncgrpo-capture-"))
    if len(str(folder / "proxy.sock")) < SOCKET_PATH_LIMIT:
        return folder
    folder.rmdir()
    return Path(tempfile.mkdtemp(prefix="asyncgrpo-capture-", dir="/tmp"))


class _Refused(HarnessError):
    """A request the proxy answers with an error status: the agent's mistake, not the run's."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error"}}, status=status)
