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
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from asyncgrpo.harness.contract import TrainingTrace, TrainingTurn
from asyncgrpo.harness.openai_chat import chat_completion, parse_sampled_turn, template_messages
from asyncgrpo.harness.trace import CaptureContractError, training_turn
from asyncgrpo.rollout.chat import render_prompt_ids
from asyncgrpo.rollout.types import TurnRecord

logger = logging.getLogger(__name__)

# Sampling one turn under the run's settings: the rollout loop's generate_one_turn.
SampleTurn = Callable[[list[int]], Awaitable[TurnRecord]]


@dataclass
class CapturedSession:
    episode_id: str
    turns: list[TrainingTurn] = field(default_factory=list)
    error: CaptureContractError | None = None  # the first contract violation, raised at fetch


@dataclass(frozen=True)
class CaptureEndpoint:
    """What a session factory needs of the proxy: where it is, what the model is called, and the
    sessions' keys and traces. Passed as `capture=` to a factory that accepts it."""

    base_url: str
    model: str
    proxy: CaptureProxy

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
    ):
        self.tokenizer = tokenizer
        self.sample_turn = sample_turn
        self.model = model
        self.chat_template_kwargs = chat_template_kwargs
        self.parse_reasoning = parse_reasoning
        self.sessions: dict[str, CapturedSession] = {}
        self._runner: web.AppRunner | None = None
        self.endpoint: CaptureEndpoint | None = None

    async def start(self, host: str = "127.0.0.1") -> CaptureEndpoint:
        """Listen on a free port of `host` (loopback: the agents run on this machine)."""
        app = web.Application(client_max_size=0)  # an agent's history has no size limit but the model's
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.endpoint = CaptureEndpoint(f"http://{host}:{port}/v1", self.model, self)
        return self.endpoint

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

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
        body = await request.json()
        if body.get("stream"):
            return _error(400, "streaming is not supported by the capture proxy: send stream=false")
        if body.get("n", 1) != 1:
            return _error(400, "n must be 1: each sampled turn is one rollout step")
        tools = body.get("tools") or None
        try:
            prompt_ids = render_prompt_ids(
                self.tokenizer,
                template_messages(body.get("messages") or []),
                tools,
                self.chat_template_kwargs,
            )
        except Exception as error:  # the template refused the agent's messages: the agent's problem
            return _error(400, f"the chat template failed on the messages ({type(error).__name__}: {error})")
        try:
            turn = await self.sample_turn(prompt_ids)
        except ValueError as error:  # no room left under max_model_len
            return _error(400, str(error))
        parsed = parse_sampled_turn(self.tokenizer, turn, bool(tools), self.parse_reasoning)
        index = len(session.turns)
        node_id = f"{session.episode_id}-{index}"
        response = chat_completion(parsed, turn, self.model, call_id_prefix=node_id)
        try:
            captured = training_turn(
                turn, node_id, {"messages": body.get("messages"), "tools": tools}, response
            )
        except CaptureContractError as error:
            session.error = session.error or error
            return _error(500, str(error))
        session.turns.append(captured)
        return web.json_response(response)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error"}}, status=status)
