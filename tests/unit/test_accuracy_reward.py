"""accuracy_reward on a small shipped sample of math problems and completions, right and wrong."""

from __future__ import annotations

import json
import os
import threading
import time

from support_paths import DATA

from asyncgrpo.rewards import accuracy_reward

SAMPLE = [json.loads(line) for line in (DATA / "math_completions.jsonl").read_text().splitlines()]


def as_completions(texts):
    return [[{"role": "assistant", "content": text}] for text in texts]


def in_a_thread(call):
    """What `call` returns when made from a thread other than the main one (as reward functions are)."""
    results = []
    thread = threading.Thread(target=lambda: results.append(call()))
    thread.start()
    thread.join(timeout=120)
    return results[0] if results else None


def test_accuracy_reward_on_the_shipped_sample():
    rewards = accuracy_reward(
        completions=as_completions([row["completion"] for row in SAMPLE]),
        solution=[row["solution"] for row in SAMPLE],
        prompts=[[{"role": "user", "content": row["problem"]}] for row in SAMPLE],
    )
    wrong = [
        (row["problem"], row["completion"], got)
        for row, got in zip(SAMPLE, rewards)
        if got != row["expected"]
    ]
    assert not wrong
    assert {0.0, 1.0} <= set(rewards), "the sample holds right and wrong answers"


def test_accuracy_reward_works_in_a_worker_thread_with_math_verify_timeouts_on():
    """Reward functions run in the worker's threads, where SIGALRM-based timeouts cannot work: there
    the answers are verified in processes whose main thread runs math-verify, timeouts on."""
    answers = ["\\boxed{\\frac{2}{4}}", "\\boxed{3}"]
    assert in_a_thread(lambda: accuracy_reward(as_completions(answers), solution=["0.5", "4"])) == [1.0, 0.0]
    from asyncgrpo.rewards import accuracy as module

    assert module._pool is not None, "verified in the pool"
    assert module._pool.run(_timeouts_on), "the pool's workers run math-verify in a main thread"


def _timeouts_on() -> bool:
    """In a pool worker: math-verify's SIGALRM timeout really fires there."""
    import time

    import math_verify.errors
    import math_verify.utils

    @math_verify.utils.timeout(timeout_seconds=1)
    def slow():
        time.sleep(5)

    try:
        slow()
    except math_verify.errors.TimeoutException:
        return True
    return False


def test_an_unparsable_reference_scores_none():
    assert accuracy_reward(as_completions(["\\boxed{1}"]), solution=["$$"]) == [None]


# An answer whose check takes math-verify past its own 5 s bounds; where the alarm cannot reach (a
# long big-integer operation) it would not come back at all.
PATHOLOGICAL = "\\boxed{9^{9^{9^{9}}}}"


def test_a_verifier_stuck_on_a_pathological_answer_is_replaced_and_the_pool_goes_on():
    from asyncgrpo.rewards.accuracy import VerifierPool, score_answer

    pool = VerifierPool(size=1, deadline_s=120)
    try:
        assert pool.run(score_answer, "\\boxed{2}", "2") == 1.0  # started, math-verify imported
        first = pool._idle.get()
        pool._idle.put(first)
        pool.deadline_s = 3  # below math-verify's own 5 s bound: the verifier is cut off, not answered
        started = time.monotonic()
        assert pool.run(score_answer, PATHOLOGICAL, "1", failed=0.0) == 0.0
        assert time.monotonic() - started < 3 + 15, "cut off at the deadline"
        assert pool.failures == 1 and not first.process.is_alive()
        pool.deadline_s = 120
        assert pool.run(score_answer, "\\boxed{\\frac{2}{4}}", "0.5") == 1.0, "a fresh verifier answers"
    finally:
        pool.close()


def test_a_verifier_that_dies_is_replaced_and_its_answer_scores_zero(monkeypatch):
    from asyncgrpo.rewards import accuracy as module

    pool = module.VerifierPool(size=2, deadline_s=120)
    monkeypatch.setattr(module, "_pool", pool)
    try:
        assert pool.run(os._exit, 1, failed=0.0) == 0.0  # the process is gone mid-call
        assert pool.failures == 1
        answers = as_completions(["\\boxed{3}", "\\boxed{4}"])
        assert in_a_thread(lambda: accuracy_reward(answers, solution=["3", "5"])) == [1.0, 0.0], (
            "every later call is answered"
        )
    finally:
        pool.close()
