"""HarnessRolloutLoop: a rollout is an OpenEnv session, run to its end by the agent (loop-owning)
or by a `HarnessAdapter` that asks the trainer for each turn (white-box).

Loop-owning: the session factory is built with the run's sampling settings (and the capture proxy,
when it accepts `capture=`); per rollout, `create()` -> `wait_for_completion()` ->
`fetch_training_trace()` -> `verify()` -> `close()`, in a thread (OpenEnv sessions are synchronous).
The trace's turns become the rollout's TurnRecords, chained into samples by exact token prefix
(rollout/sequences.py), each turn keeping the policy version that sampled it. The reward is
`rollout_reward_fn(outcome)` when given, else `verify()`'s; None leaves the rollout out of its
group's baseline. An agent that fails (exits non-zero, runs past its timeout, never calls the model,
or a session that cannot be created or verified) is an unscorable rollout, warned about and counted
(`rollout/harness_failed_count`); a trace that breaks the capture contract stops the run.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from asyncgrpo.harness.capture import CaptureProxy
from asyncgrpo.harness.contract import HarnessRunLimits
from asyncgrpo.harness.tool_metrics import ToolCallCounts, captured_tool_calls, white_box_tool_calls
from asyncgrpo.harness.trace import CaptureContractError, turns_from_trace
from asyncgrpo.harness.white_box import WhiteBoxSampler
from asyncgrpo.metrics import Reduce
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.types import Rollout, TurnRecord

logger = logging.getLogger(__name__)

# A white-box adapter's turn limit when max_tool_calling_iterations is unset (TRL's).
DEFAULT_WHITE_BOX_TURNS = 8


@dataclass
class HarnessRolloutOutcome:
    """What `rollout_reward_fn` scores (TRL's fields). `timed_out` is always False here: an agent
    that runs past its timeout is unscorable and never reaches `rollout_reward_fn`."""

    env_reward: float | None
    completion: list[dict[str, Any]]
    trace: list[dict[str, Any]]  # the capture's trace entries (TrainingTrace.to_trace_entries)
    tool_call_count: int
    tool_failure_count: int
    tool_calls_by_name: dict[str, int]
    timed_out: bool = False


@dataclass(frozen=True)
class HarnessSettings:
    """The trainer's harness arguments, as the rollout process receives them."""

    session_factory: Callable[..., Any]
    adapter: Any = None  # an OpenEnv HarnessAdapter (or one of the same shape): white-box
    rollout_reward_fn: Callable[[HarnessRolloutOutcome], float | None] | None = None


class SessionFailure(Exception):
    """The agent or its session failed: the rollout is unscorable (not a training error)."""


@dataclass
class _SessionResult:
    turns: list[TurnRecord] = field(default_factory=list)
    completion: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    env_reward: float | None = None
    tools: ToolCallCounts = field(default_factory=ToolCallCounts)
    failure: str | None = None


class HarnessRolloutLoop(AsyncRolloutLoop):
    def __init__(self, *args, harness: HarnessSettings, **kwargs):
        super().__init__(*args, **kwargs)
        self.harness = harness
        self._factory = None
        self._proxy: CaptureProxy | None = None
        self._session_pool: ThreadPoolExecutor | None = None
        self._live_sessions: set = set()
        self._sessions_lock = threading.Lock()
        self._closing = False

    async def setup(self) -> None:
        config = self.config
        self._session_pool = ThreadPoolExecutor(
            max_workers=config.max_concurrent_rollouts, thread_name_prefix="harness-session"
        )
        if self.harness.adapter is not None:
            self._factory = self.harness.session_factory()
            return
        self._proxy = CaptureProxy(
            self.tokenizer,
            self.generate_one_turn,
            self.model_name,
            config.chat_template_kwargs,
            config.parse_reasoning,
            max_request_bytes=int(config.harness_max_request_mb * 2**20),
        )
        endpoint = await self._proxy.start()
        sampling = {
            "temperature": config.temperature,
            "top_p": config.top_p,
            "top_k": config.top_k,
            "min_p": config.min_p or 0.0,
            "repetition_penalty": config.repetition_penalty,
        }
        kwargs: dict[str, Any] = {"sampling": sampling}
        if _accepts(self.harness.session_factory, "capture"):
            kwargs["capture"] = endpoint
        self._factory = self.harness.session_factory(**kwargs)

    async def close(self) -> None:
        """End every live session (their agents and children), then the proxy."""
        with self._sessions_lock:
            self._closing = True
            sessions = list(self._live_sessions)
        await asyncio.gather(*(asyncio.to_thread(_close_quietly, session) for session in sessions))
        if self._session_pool is not None:
            self._session_pool.shutdown(wait=False, cancel_futures=True)
        if callable(getattr(self._factory, "close", None)):  # a factory's own processes (a reaper)
            await asyncio.to_thread(self._factory.close)
        if self._proxy is not None:
            await self._proxy.stop()

    async def generate_one(self, prompt, tools, group_id: int = 0) -> Rollout:
        row = self.dataset_row()
        task = row if getattr(self._factory, "takes_dataset_row", False) else prompt
        version = self._sampler.model_version_value.value
        started = time.monotonic()
        result = await asyncio.get_running_loop().run_in_executor(
            self._session_pool, self._run_session, task, group_id, version, asyncio.get_running_loop()
        )
        metrics = self.metrics
        metrics.record("rollout/harness_failed_count", int(result.failure is not None), Reduce.SUM)
        if result.failure is not None:
            logger.warning(
                "harness rollout for dataset prompt %s is unscorable after %.1f s: %s",
                str(prompt)[:80],
                time.monotonic() - started,
                result.failure,
            )
        if self.harness.rollout_reward_fn is not None and result.env_reward is not None:
            metrics.record("rollout/correctness_mean", result.env_reward)
        if result.reward is not None:
            metrics.record("rewards/harness_reward/mean", result.reward)
        result.tools.record(metrics)
        calls = result.tools.total
        return Rollout(
            completion=result.completion,
            completion_ids=[token for turn in result.turns for token in turn.output_ids],
            turns=result.turns,
            tool_call_count=calls,
            reward=result.reward,
        )

    # -- one session, on a pool thread ------------------------------------------------------------------

    def _run_session(self, task, group_id: int, version: int, event_loop) -> _SessionResult:
        episode_id = uuid.uuid4().hex
        with self._sessions_lock:
            if self._closing:
                return _SessionResult(failure="the trainer is stopping")
            try:
                # One seed per group: every rollout of a prompt gets the same task.
                session = self._factory.create(task, seed=group_id, episode_id=episode_id)
            except Exception as error:
                return _SessionResult(failure=f"the session could not be created: {error!r}")
            self._live_sessions.add(session)
        try:
            if self.harness.adapter is not None:
                return self._white_box(session, event_loop)
            return self._loop_owning(session, version)
        except CaptureContractError:
            raise
        except SessionFailure as failure:
            return _SessionResult(failure=str(failure))
        except Exception as error:  # the session's own code (verify, the adapter) failed
            return _SessionResult(failure=f"the session failed: {error!r}")
        finally:
            with self._sessions_lock:
                self._live_sessions.discard(session)
            _close_quietly(session)

    def _loop_owning(self, session, version: int) -> _SessionResult:
        if not callable(getattr(session, "fetch_training_trace", None)):
            raise CaptureContractError(
                f"{type(session).__name__} has no fetch_training_trace(): loop-owning training needs the "
                "session's captured turns (OpenEnv's TrainableSession); give a harness_adapter to sample "
                "each turn in the trainer instead"
            )
        try:
            exit_code = session.wait_for_completion()
        except TimeoutError as error:
            raise SessionFailure(f"{error}{_output_of(session)}") from None
        if exit_code:
            raise SessionFailure(f"the agent exited with code {exit_code}{_output_of(session)}")
        try:
            trace = session.fetch_training_trace()
        except ValueError as error:  # pydantic's ValidationError among them: the producer broke the contract
            if isinstance(error, CaptureContractError):
                raise
            raise CaptureContractError(
                f"the session's training trace breaks the capture contract: {error}"
            ) from error
        top_n = self.config.num_sampler_logprobs if self.config.score_centering else 0
        turns = turns_from_trace(trace, version, top_n)
        if not turns:
            raise SessionFailure(f"the agent exited without calling the model{_output_of(session)}")
        entries = trace.to_trace_entries()
        completion = _transcript(entries)
        return self._score(session, turns, completion, entries, captured_tool_calls(entries))

    def _white_box(self, session, event_loop) -> _SessionResult:
        sampler = WhiteBoxSampler(self, event_loop)
        limit = self.config.max_tool_calling_iterations
        limits = HarnessRunLimits(
            max_turns=limit if limit is not None else DEFAULT_WHITE_BOX_TURNS,
            sampling={
                "temperature": self.config.temperature,
                "max_tokens": self.config.max_completion_length,
            },
        )
        result = self.harness.adapter.run_white_box(sampler, session, limits)
        if not sampler.turns:
            raise SessionFailure("the harness adapter finished without sampling a turn")
        tools = white_box_tool_calls(result.tool_trace, sampler.offered)
        return self._score(session, sampler.turns, list(result.messages), [], tools)

    def _score(self, session, turns, completion, entries, tools: ToolCallCounts) -> _SessionResult:
        verified = session.verify(completion)
        env_reward = None if verified.env_reward is None else float(verified.env_reward)
        reward = env_reward
        if self.harness.rollout_reward_fn is not None:
            outcome = HarnessRolloutOutcome(
                env_reward=env_reward,
                completion=completion,
                trace=entries,
                tool_call_count=tools.total,
                # Loop-owning, the agent runs its tools: their failures are its own business.
                tool_failure_count=sum((tools.failures or {}).values()),
                tool_calls_by_name=dict(tools.calls),
            )
            reward = self.harness.rollout_reward_fn(outcome)
        return _SessionResult(turns, completion, reward, env_reward, tools)


def _accepts(factory: Callable, name: str) -> bool:
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _close_quietly(session) -> None:
    try:
        session.close()
    except Exception:
        logger.warning("closing a harness session failed", exc_info=True)


def _output_of(session) -> str:
    tail = session.output_tail() if callable(getattr(session, "output_tail", None)) else ""
    return f"; its output ends with:\n{tail}" if tail else ""


def _transcript(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as the agent last sent it, and the model's last reply."""
    if not entries:
        return []
    last = entries[-1]
    choices = (last.get("response") or {}).get("choices") or [{}]
    return list((last.get("request") or {}).get("messages") or []) + [dict(choices[0].get("message") or {})]
