"""accuracy_reward: is the completion's final answer mathematically equal to the reference?

Works on `\\boxed{}` answers and on DeepMath-style data (a `solution` column holding the reference
answer). Uses math-verify, which compares parsed expressions (2/4 equals \\frac{1}{2}), not strings.
Only the answer is judged: a closed `<think>...</think>` block, which `content` holds unless
`parse_reasoning` moved it out, is left aside (an expression tried while reasoning is no answer).

math-verify bounds its own parsing and comparison time (some expressions make sympy run for minutes)
with SIGALRM, which only works in a process's main thread, and reward functions run in the rollout
worker's threads. So from a thread the answers are verified in a small pool of processes, each
running math-verify in its main thread with its timeouts on; from a main thread they are verified
in place. A timed-out comparison scores 0.0, as math-verify returns it.

The alarm cannot interrupt work inside one C call (a big-integer power or factorial), and a verifier
process can die (killed for its memory). Each answer the pool verifies has a deadline of its own,
`VERIFY_DEADLINE_S`: a verifier past it, or dead, is killed and replaced by a fresh process, the
answer scores 0.0 (an answer that cannot be checked is not a right one) and is counted
(`VerifierPool.failures`, and a warning the first time). The other verifiers, and every later call,
go on as before (docs/reliability.md).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import threading
from typing import Any

from asyncgrpo.errors import RewardError
from asyncgrpo.rollout.tool_calls import split_reasoning

logger = logging.getLogger(__name__)

VERIFY_PROCESSES = 2
# math-verify's own bounds are 5 s per parse and per comparison, and a reference is parsed up to three
# times: well within this, so only a verifier stuck where its alarm cannot reach is cut off.
VERIFY_DEADLINE_S = 60.0
_pool: VerifierPool | None = None
_pool_lock = threading.Lock()


def _math_verify():
    try:
        import math_verify
        from math_verify import LatexExtractionConfig
    except ImportError as error:  # an optional dependency
        raise ImportError("accuracy_reward needs math-verify: pip install 'asyncgrpo[math]'") from error
    return math_verify, LatexExtractionConfig


def _parse_reference(solution: str):
    math_verify, _ = _math_verify()
    for text in (f"${solution}$", f"\\boxed{{{solution}}}", solution):
        parsed = math_verify.parse(text)
        if parsed:
            return parsed
    return []


def score_answer(content: str, reference: str) -> float | None:
    """1.0 / 0.0 for one completion, None when the reference cannot be parsed. Must run in a main
    thread: math-verify's timeouts (SIGALRM) are on."""
    math_verify, LatexExtractionConfig = _math_verify()
    gold = _parse_reference(str(reference))
    if not gold:
        logger.debug("accuracy_reward: cannot parse the reference %r", reference)
        return None
    answer = math_verify.parse(
        content,
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)],
        extraction_mode="first_match",
    )
    return float(math_verify.verify(gold, answer)) if answer else 0.0


class VerifierPool:
    """Up to `size` verifier processes (spawned, math-verify in their main thread), each running one
    call at a time under `deadline_s`. Callers in many threads share them; a call waits for a free
    one. A verifier past its deadline, or dead, is killed and replaced: its call returns `failed`."""

    def __init__(self, size: int = VERIFY_PROCESSES, deadline_s: float = VERIFY_DEADLINE_S):
        self.size, self.deadline_s = size, deadline_s
        self.failures = 0  # calls cut off (past the deadline) or lost (the process died)
        self._idle: queue.SimpleQueue[_Verifier] = queue.SimpleQueue()
        self._started = 0
        self._lock = threading.Lock()

    def run(self, function, *args, failed=None):
        """`function(*args)` in a verifier process (`function` must be importable there); `failed`
        when the verifier ran past the deadline or died."""
        verifier = self._take()
        try:
            outcome, value = verifier.call(function, args, self.deadline_s)
        except _VerifierLost as lost:
            self._replace(verifier)
            with self._lock:
                self.failures += 1
                first = self.failures == 1
            (logger.warning if first else logger.info)(
                "accuracy_reward: a verifier was replaced (%s); the answer scores %r. Replaced so far: %d",
                lost,
                failed,
                self.failures,
            )
            return failed
        except BaseException:  # interrupted mid-call: the process may still answer it, so it goes
            self._replace(verifier)
            raise
        self._idle.put(verifier)
        if outcome == "error":
            raise value
        return value

    def _replace(self, verifier: _Verifier) -> None:
        verifier.kill()
        with self._lock:
            self._started -= 1  # the next call starts a fresh verifier in its place

    def _take(self) -> _Verifier:
        with self._lock:
            if self._idle.empty() and self._started < self.size:
                self._started += 1
                return _Verifier()
        return self._idle.get()

    def close(self) -> None:
        while not self._idle.empty():
            self._idle.get().kill()


class _VerifierLost(RewardError):
    """A verifier that will not answer: past its deadline, or dead."""


class _Verifier:
    """One verifier process and the parent's end of its pipe."""

    def __init__(self):
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, os.getpid()), daemon=True)
        self.process.start()
        child.close()

    def call(self, function, args: tuple, deadline_s: float) -> tuple[str, Any]:
        """("ok", the result) or ("error", the exception raised); _VerifierLost past the deadline or
        when the process died."""
        try:
            self.connection.send((function, args))
            if not self.connection.poll(deadline_s):
                raise _VerifierLost(f"still running after {deadline_s:g} s")
            return self.connection.recv()
        except (EOFError, OSError):
            raise _VerifierLost("its process died") from None

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=10)
        self.connection.close()


def _serve(connection, parent_pid: int) -> None:
    """A verifier's main: calls from the pipe, run in this main thread (math-verify's alarm works
    here), answered one by one."""
    from asyncgrpo.run.parent_watch import exit_when_parent_dies

    exit_when_parent_dies(parent_pid)  # never outlive the process that uses it
    while True:
        function, args = connection.recv()
        try:
            connection.send(("ok", function(*args)))
        except Exception as error:
            connection.send(("error", error))


def _verifier_pool() -> VerifierPool:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = VerifierPool()
        return _pool


def accuracy_reward(
    completions: list[list[dict[str, str]]], solution: list[str], **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion's last message answers `solution` correctly, 0.0 when not, None when
    the reference itself cannot be parsed (the item is left out of the reward)."""
    contents = [
        split_reasoning(completion[-1]["content"])[1] if completion else "" for completion in completions
    ]
    references = [str(reference) for reference in solution]
    if threading.current_thread() is threading.main_thread():
        return [score_answer(content, reference) for content, reference in zip(contents, references)]
    pool = _verifier_pool()
    return [
        pool.run(score_answer, content, reference, failed=0.0)
        for content, reference in zip(contents, references)
    ]
