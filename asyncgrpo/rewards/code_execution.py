"""code_execution_reward: run the Python program a completion wrote against its row's tests, in the
sandbox (asyncgrpo.sandbox.run: no network, nothing of the machine visible, bounded memory,
processes, files and time).

The program is the completion's last fenced code block (```python ... ```, or ``` ... ```), its
reasoning block left aside. The row's `tests` column says how it is judged:

- a list of input/output cases, `{"input": str, "output": str}`: the program runs once per case
  with the input on stdin; a case passes when its standard output equals the expected output
  (line by line, trailing whitespace aside). The reward is the fraction of cases passed. The
  verdict is taken outside the sandbox from what the program printed: it cannot be forged.
- Python code (a string, or a list of strings run one after another), e.g. `assert f(2) == 4`: run
  after the program in the same interpreter; the reward is 1.0 when every test ran without an
  exception and 0.0 otherwise. The end of the run is marked by a random token printed after the
  last test: a program that exits early with status 0, or prints a success line, does not pass.
  Code written to read the runner's own memory could find that token (the tests run in its
  process); where that matters, use input/output cases.

A program that hangs, crashes, forks without end, fills its memory or the disk scores 0.0: its run
is a failed one, never an exception (`failures` counts them by how they ended). A completion without
a code block scores 0.0; a row without tests, None (unscorable).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import secrets
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncgrpo.rollout.tool_calls import split_reasoning
from asyncgrpo.sandbox import CODE_LIMITS, SandboxLimits, SandboxResult, check_available, run

logger = logging.getLogger(__name__)

# Seconds one run of a program may take: a test suite of a small function, on a loaded machine.
TIMEOUT_S = 10.0
# Runs at once (one per core: each is a process working flat out).
PARALLEL_RUNS = max(1, len(os.sched_getaffinity(0)))
# How each failed run ended, over the process's life.
failures: collections.Counter[str] = collections.Counter()
_failures_lock = threading.Lock()
_FENCE = "```"
# The runner of assert-style tests: the program, then each test, then the token that says they all ran.
RUNNER = """import sys
token = sys.stdin.readline().strip()
sys.stdin.close()
namespace = {"__name__": "__main__"}
exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
for index, test in enumerate(__import__("json").load(open("tests.json"))):
    exec(compile(test, "test_%d.py" % index, "exec"), namespace)
print(token, flush=True)
"""


def code_execution_reward(completions: list, tests: list, **kwargs: Any) -> list[float | None]:
    """One reward per completion: its last code block run against its row's `tests` in the sandbox
    (the module's docstring says how each kind of test is judged)."""
    jobs = [(_program(completion), row_tests) for completion, row_tests in zip(completions, tests)]
    with ThreadPoolExecutor(max_workers=PARALLEL_RUNS, thread_name_prefix="code-reward") as pool:
        return list(pool.map(lambda job: score(*job, timeout_s=TIMEOUT_S), jobs))


def _check_before_rollouts() -> None:
    check_available()


# The trainer calls this when it is built: a machine that cannot start the sandbox stops the run
# before its first rollout (asyncgrpo/trainer/checks.py).
code_execution_reward.check_before_rollouts = _check_before_rollouts


def score(
    program: str | None, tests: Any, timeout_s: float = TIMEOUT_S, limits: SandboxLimits = CODE_LIMITS
) -> float | None:
    """The reward of one program against one row's tests (None: the row has no tests)."""
    if tests is None or tests == [] or tests == "":
        return None
    if program is None:
        return 0.0
    if isinstance(tests, list) and all(isinstance(case, dict) for case in tests):
        passed = [_passes_case(program, case, timeout_s, limits) for case in tests]
        return sum(passed) / len(passed)
    snippets = [tests] if isinstance(tests, str) else [str(test) for test in tests]
    token = secrets.token_hex(16)
    files = {"runner.py": RUNNER, "solution.py": program, "tests.json": json.dumps(snippets)}
    result = run([sys.executable, "-I", "runner.py"], files, timeout_s, stdin=token + "\n", limits=limits)
    passed = result.ok and result.stdout.rstrip().endswith(token)
    if not passed:
        _count(result)
    return float(passed)


def _passes_case(program: str, case: dict, timeout_s: float, limits: SandboxLimits) -> bool:
    result = run(
        [sys.executable, "-I", "solution.py"],
        {"solution.py": program},
        timeout_s,
        stdin=str(case.get("input", "")),
        limits=limits,
    )
    passed = result.ok and _lines(result.stdout) == _lines(str(case.get("output", "")))
    if not passed:
        _count(result)
    return passed


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


def _count(result: SandboxResult) -> None:
    if result.timed_out:
        how = "timeout"
    elif result.over_disk:
        how = "disk"
    elif result.exit_code and result.exit_code > 128:
        how = "killed"
    elif result.exit_code:
        how = "error"
    else:
        how = "wrong"
    with _failures_lock:
        failures[how] += 1


def _program(completion: Any) -> str | None:
    """The last fenced code block of a completion (a string, or messages: the last one's content)."""
    if isinstance(completion, list):
        completion = (completion[-1] or {}).get("content") if completion else ""
    text = split_reasoning(str(completion or ""))[1]
    parts = text.split(_FENCE)
    if len(parts) < 3:
        return None
    block = parts[-2] if len(parts) % 2 == 1 else parts[-3]  # an unclosed last fence is not a block
    first_line, _, body = block.partition("\n")
    return body if first_line.strip().isidentifier() or not first_line.strip() else block
