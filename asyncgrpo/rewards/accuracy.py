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
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from asyncgrpo.rollout.tool_calls import split_reasoning

logger = logging.getLogger(__name__)

VERIFY_PROCESSES = 2
_pool: ProcessPoolExecutor | None = None
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


def _verifier_pool() -> ProcessPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            from asyncgrpo.parent_watch import exit_when_parent_dies

            _pool = ProcessPoolExecutor(
                VERIFY_PROCESSES,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=exit_when_parent_dies,  # never outlive the process that uses them
                initargs=(os.getpid(),),
            )
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
    return list(_verifier_pool().map(score_answer, contents, references))
