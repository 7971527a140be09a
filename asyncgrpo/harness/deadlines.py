"""Deadlines on the harness's calls into user code: a session's `create()`, `verify()` and `close()`,
`rollout_reward_fn`, the white-box adapter's run and the session's tools.

OpenEnv sessions are synchronous and a Python thread cannot be stopped, so each call runs in a
daemon thread of its own and the caller waits for it at most `timeout_s`: past it the call is
abandoned (its thread left to finish, or to hang, without holding anything of the run's) and the
caller gets `DeadlineExceeded`. The rollout worker leaves with `os._exit`, so an abandoned thread
never keeps it alive (docs/reliability.md).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import math
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from asyncgrpo.errors import HarnessError
from asyncgrpo.harness.contract import ToolResult
from asyncgrpo.rollout.activity import ActivityBoard

Result = TypeVar("Result")


class DeadlineExceeded(HarnessError):
    """A call into user code ran past its deadline and was abandoned."""

    def __init__(self, what: str, timeout_s: float, setting: str):
        super().__init__(
            f"{what} did not return within {setting}={timeout_s:g} s; it was abandoned (its thread left "
            f"running) and the rollout is unscored. Fix it, or raise {setting}."
        )
        self.what = what


def call_with_deadline(
    function: Callable[[], Result],
    timeout_s: float,
    what: str,
    setting: str,
    on_late_result: Callable[[Result], None] | None = None,
) -> Result:
    """`function()`'s result or exception, or DeadlineExceeded after `timeout_s` seconds (naming
    `what` and the `setting` that bounds it). A result that arrives after the deadline goes to
    `on_late_result`, from the call's thread: what holds resources (a session whose agent was started)
    is then released by its owner's code instead of being left to run."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    context = contextvars.copy_context()
    lock = threading.Lock()  # the deadline and the result: exactly one of them wins
    abandoned = False

    def run() -> None:
        try:
            result = context.run(function)
        except BaseException as error:  # handed to the caller, whatever it is
            with lock:
                if not abandoned:
                    future.set_exception(error)
            return
        with lock:
            late = abandoned
            if not late:
                future.set_result(result)
        if late and on_late_result is not None:
            on_late_result(result)

    threading.Thread(target=run, name=f"harness-call {what}"[:60], daemon=True).start()
    # Not future.result(timeout): its TimeoutError is the builtin, which the call may raise itself.
    concurrent.futures.wait([future], timeout=None if math.isinf(timeout_s) else timeout_s)
    with lock:
        if not future.done():
            abandoned = True
    if abandoned:
        raise DeadlineExceeded(what, timeout_s, setting)
    return future.result()


class ToolDeadlineSession:
    """The session a white-box adapter is given: the user's session, each `call_tool` under
    `tool_timeout`. A call past it returns a tool error (what the model sees, as in the built-in tool
    loop) and is counted in `timeouts`."""

    def __init__(self, session: Any, timeout_s: float, activity: ActivityBoard):
        self.session = session
        self.timeout_s = timeout_s
        self.activity = activity
        self.timeouts = 0
        self._lock = threading.Lock()  # an adapter may call tools from several threads

    def initial_messages(self):
        return self.session.initial_messages()

    def list_tools(self):
        return self.session.list_tools()

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        try:
            with self.activity.waiting_on(f"tool {name!r}"):
                return call_with_deadline(
                    lambda: self.session.call_tool(name, arguments),
                    self.timeout_s,
                    f"tool {name!r}",
                    "tool_timeout",
                )
        except DeadlineExceeded:
            with self._lock:
                self.timeouts += 1
            return ToolResult(error=f"the tool did not return within tool_timeout={self.timeout_s:g} s")

    def verify(self, transcript, final_state=None):
        return self.session.verify(transcript, final_state)

    def close(self) -> None:
        self.session.close()

    def __getattr__(self, name: str):  # anything else of the user's session, as it is
        return getattr(self.session, name)
