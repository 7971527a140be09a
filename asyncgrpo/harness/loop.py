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

Every call into the session's code has a deadline (harness/deadlines.py): `verify()` and
`rollout_reward_fn` `reward_timeout`, each white-box tool call `tool_timeout`, the rest (`create()`,
the adapter's run, the trace, `close()`) the trainer's `harness_timeout_s`. A call past its deadline
makes the rollout unscorable and counts in `rollout/harness_timeout_count` (a tool's: a tool error
the model sees, and `tools/timeout_count`). A factory that states `max_live_sessions` (a process per
session) has at most that many sessions alive at once (harness/session_gate.py).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass, field
from typing import Any, Callable

from asyncgrpo.errors import HarnessError
from asyncgrpo.harness.capture import CaptureProxy
from asyncgrpo.harness.contract import HarnessRunLimits
from asyncgrpo.harness.deadlines import DeadlineExceeded, ToolDeadlineSession, call_with_deadline
from asyncgrpo.harness.session_gate import SessionGate
from asyncgrpo.harness.tool_metrics import ToolCallCounts, captured_tool_calls, white_box_tool_calls
from asyncgrpo.harness.trace import CaptureContractError, turns_from_trace
from asyncgrpo.harness.white_box import WhiteBoxSampler
from asyncgrpo.records.metrics import Reduce
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.types import Rollout, TurnRecord

logger = logging.getLogger(__name__)

# A white-box adapter's turn limit when max_tool_calling_iterations is unset (TRL's).
DEFAULT_WHITE_BOX_TURNS = 8
# How long the trainer waits on a session's own code at each call (create, the adapter's run, the
# trace, close) by default: as long as a server request may take, so it never cuts a working session.
DEFAULT_HARNESS_TIMEOUT_S = 1800.0
HARNESS_TIMEOUT = "harness_timeout_s"
# How long close() gives the sessions still being created or scored, once it has closed the live ones,
# to see that the loop is closing and close themselves: a create() takes a fraction of a second, and the
# rollout process leaves with os._exit after close(), so a session created after it would leave its
# folder behind. Within the trainer's bound on stopping the rollout process (10 s, then SIGKILL).
SETTLE_BOUND_S = 5.0


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
    timeout_s: float = DEFAULT_HARNESS_TIMEOUT_S


class SessionFailure(HarnessError):
    """The agent or its session failed: the rollout is unscorable (not a training error)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


@dataclass
class _SessionResult:
    turns: list[TurnRecord] = field(default_factory=list)
    completion: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    env_reward: float | None = None
    tools: ToolCallCounts = field(default_factory=ToolCallCounts)
    failure: str | None = None
    timed_out: bool = False  # a call ran past its deadline (the failure says which)
    tool_timeouts: int = 0


class HarnessRolloutLoop(AsyncRolloutLoop):
    def __init__(self, *args, harness: HarnessSettings, **kwargs):
        super().__init__(*args, **kwargs)
        self.harness = harness
        self._factory = None
        self._proxy: CaptureProxy | None = None
        self._session_pool: ThreadPoolExecutor | None = None
        self._live_sessions: set = set()
        self._in_flight: set[Future] = set()  # _run_session calls on the pool's threads
        self._sessions_lock = threading.Lock()  # held for set operations only, never while a session starts
        self._closing = False
        self._gate = SessionGate(None)

    async def setup(self) -> None:
        config = self.config
        self._session_pool = ThreadPoolExecutor(
            max_workers=config.max_concurrent_rollouts, thread_name_prefix="harness-session"
        )
        if self.harness.adapter is not None:
            self._factory = self.harness.session_factory()
            self._bound_live_sessions()
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
        self._bound_live_sessions()

    def _bound_live_sessions(self) -> None:
        """The gate on live sessions, from the factory's `max_live_sessions` (None: no bound)."""
        limit = getattr(self._factory, "max_live_sessions", None)
        self._gate = SessionGate(limit)
        if limit is not None:
            logger.info("harness: at most %d sessions (agent processes) alive at once (max_agents)", limit)

    async def close(self) -> None:
        """End every live session (their agents and children), then the proxy."""
        with self._sessions_lock:
            self._closing = True
            sessions = list(self._live_sessions)
        await asyncio.gather(*(asyncio.to_thread(self._close_quietly, session) for session in sessions))
        if self._session_pool is not None:
            self._session_pool.shutdown(wait=False, cancel_futures=True)
            await asyncio.to_thread(wait_for_futures, list(self._in_flight), SETTLE_BOUND_S)
        if callable(getattr(self._factory, "close", None)):  # its own resources (the agents' lifeline)
            await asyncio.to_thread(
                self._bounded, self._factory.close, self.harness.timeout_s, "the factory's close()"
            )
        if self._proxy is not None:
            await self._proxy.stop()

    async def generate_one(self, prompt, tools, group_id: int = 0) -> Rollout:
        row = self.dataset_row()
        task = row if getattr(self._factory, "takes_dataset_row", False) else prompt
        version = self.context.sampler.model_version_value.value
        started = time.monotonic()
        with self.context.activity.waiting_on(f"a place for a harness session ({self._gate.what})"):
            waited_s = await self._gate.acquire()
        try:
            if self._gate.limit is not None:
                self.metrics.record("rollout/harness_session_wait_s", waited_s)
            running = self._session_pool.submit(
                self._run_session, task, group_id, version, asyncio.get_running_loop()
            )
            self._in_flight.add(running)
            running.add_done_callback(self._in_flight.discard)
            result = await asyncio.wrap_future(running)
        finally:
            self._gate.release()
        metrics = self.metrics
        metrics.record("rollout/harness_failed_count", int(result.failure is not None), Reduce.SUM)
        metrics.record("rollout/harness_timeout_count", int(result.timed_out), Reduce.SUM)
        if result.tool_timeouts:
            metrics.record("tools/timeout_count", result.tool_timeouts, Reduce.SUM)
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
        if self._closing:
            return _SessionResult(failure="the trainer is stopping")
        timeout = self.harness.timeout_s
        try:
            # One seed per group: every rollout of a prompt gets the same task.
            # A create() that returns past its deadline has started an agent nobody waits for: it is
            # closed then, so max_agents bounds the agents alive, not only the sessions waited on.
            session = self._bounded(
                lambda: self._factory.create(task, seed=group_id, episode_id=episode_id),
                timeout,
                "the session factory's create()",
                on_late_result=self._close_quietly,
            )
        except DeadlineExceeded as error:
            return _SessionResult(failure=str(error), timed_out=True)
        except Exception as error:
            return _SessionResult(failure=f"the session could not be created: {error!r}")
        with self._sessions_lock:
            stopping = self._closing
            if not stopping:
                self._live_sessions.add(session)
        if stopping:  # close() has taken its list of sessions already: this one is ours to close
            self._close_quietly(session)
            return _SessionResult(failure="the trainer is stopping")
        try:
            if self.harness.adapter is not None:
                return self._white_box(session, event_loop)
            return self._loop_owning(session, version)
        except CaptureContractError:
            raise
        except SessionFailure as failure:
            return _SessionResult(failure=str(failure), timed_out=failure.timed_out)
        except DeadlineExceeded as error:
            return _SessionResult(failure=f"{error}{_output_of(session)}", timed_out=True)
        except Exception as error:  # the session's own code (verify, the adapter) failed
            return _SessionResult(failure=f"the session failed: {error!r}")
        finally:
            with self._sessions_lock:
                self._live_sessions.discard(session)
            self._close_quietly(session)

    def _bounded(
        self,
        function: Callable[[], Any],
        timeout_s: float,
        what: str,
        setting: str = HARNESS_TIMEOUT,
        on_late_result: Callable[[Any], None] | None = None,
    ):
        """`function()` under its deadline, and on the activity board while it runs."""
        with self.context.activity.waiting_on(what):
            return call_with_deadline(function, timeout_s, what, setting, on_late_result)

    def _close_quietly(self, session) -> None:
        try:
            self._bounded(session.close, self.harness.timeout_s, "the session's close()")
        except Exception:
            logger.warning("closing a harness session failed", exc_info=True)

    def _loop_owning(self, session, version: int) -> _SessionResult:
        if not callable(getattr(session, "fetch_training_trace", None)):
            raise CaptureContractError(
                f"{type(session).__name__} has no fetch_training_trace(): loop-owning training needs the "
                "session's captured turns (OpenEnv's TrainableSession); give a harness_adapter to sample "
                "each turn in the trainer instead"
            )
        # A session with a timeout of its own (ProcessSession's timeout_s) ends its agent by itself; the
        # harness's deadline is then a backstop beyond it.
        own_timeout = getattr(session, "timeout_s", None)
        deadline = self.harness.timeout_s + (own_timeout if isinstance(own_timeout, (int, float)) else 0.0)
        try:
            exit_code = self._bounded(session.wait_for_completion, deadline, "the agent's run")
        except TimeoutError as error:
            raise SessionFailure(f"{error}{_output_of(session)}", timed_out=True) from None
        if exit_code:
            raise SessionFailure(f"the agent exited with code {exit_code}{_output_of(session)}")
        try:
            trace = self._bounded(
                session.fetch_training_trace, self.harness.timeout_s, "fetch_training_trace()"
            )
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
        guarded = ToolDeadlineSession(session, self.config.tool_timeout, self.context.activity)
        try:
            result = self._bounded(
                lambda: self.harness.adapter.run_white_box(sampler, guarded, limits),
                self.harness.timeout_s,
                "the harness adapter's run_white_box()",
            )
        except DeadlineExceeded as error:
            return _SessionResult(failure=str(error), timed_out=True, tool_timeouts=guarded.timeouts)
        if not sampler.turns:
            raise SessionFailure("the harness adapter finished without sampling a turn")
        tools = white_box_tool_calls(result.tool_trace, sampler.offered)
        scored = self._score(session, list(sampler.turns), list(result.messages), [], tools)
        scored.tool_timeouts = guarded.timeouts
        return scored

    def _score(self, session, turns, completion, entries, tools: ToolCallCounts) -> _SessionResult:
        timeout = self.config.reward_timeout
        verified = self._bounded(lambda: session.verify(completion), timeout, "verify()", "reward_timeout")
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
            reward = self._bounded(
                lambda: self.harness.rollout_reward_fn(outcome),
                timeout,
                "rollout_reward_fn",
                "reward_timeout",
            )
        return _SessionResult(turns, completion, reward, env_reward, tools)


def _accepts(factory: Callable, name: str) -> bool:
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


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
