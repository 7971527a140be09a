"""code_execution_reward (asyncgrpo/rewards/code_execution.py): the model's program run against its row's
tests in the sandbox. Right programs pass, wrong ones fail, and hostile ones (a hang, a crash, a fork
bomb, a memory or disk flood, an early exit, a forged success line, a program that looks for the
trainer's secrets) score 0.0 without an exception, each counted by how it ended."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

from asyncgrpo.rewards import code_execution, code_execution_reward  # noqa: E402


def block(code: str) -> list[dict]:
    """A conversational completion whose answer is `code` in a fenced block, after its reasoning."""
    return [{"role": "assistant", "content": f"<think>easy</think>Here:\n```python\n{code}\n```\nDone."}]


SQUARE = "def square(x):\n    return x * x"
ASSERTS = ["assert square(2) == 4", "assert square(-3) == 9"]
ECHO_SUM = "print(sum(int(x) for x in input().split()))"
IO_CASES = [
    {"input": "1 2\n", "output": "3\n"},
    {"input": "5 5\n", "output": "10"},
    {"input": "0\n", "output": "1"},
]

HOSTILE = {
    "hang": "import time\ntime.sleep(3600)",
    "crash": "import ctypes\nctypes.string_at(0)",
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "memory flood": "held = []\nwhile True:\n    held.append(bytearray(2**24))",
    "disk flood": "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * 2**22)\n    i += 1",
    "early exit": "import os\nos._exit(0)",
    "forged success": "print('all tests passed')\nraise SystemExit(0)",
}
# A program that prints what it finds of the trainer's secrets, judged by an input/output case that
# expects the secret: it passes only if it found it.
SPY = (
    "import glob, os\nfound = []\nfor path in glob.glob('/proc/*/environ'):\n    try:\n"
    "        found += [e for e in open(path, 'rb').read().split(b'\\0') if e.startswith(b'HF_TOKEN=')]\n"
    "    except OSError:\n        pass\nprint(found[0].decode() if found else 'nothing')"
)


def test_right_programs_pass_and_wrong_ones_fail():
    completions = [block(SQUARE), block("def square(x):\n    return x + x"), block(ECHO_SUM)]
    completions += [[{"role": "assistant", "content": "no code here"}], "```\n" + SQUARE + "\n```"]
    tests = [ASSERTS, ASSERTS, IO_CASES, ASSERTS, "\n".join(ASSERTS)]
    assert code_execution_reward(completions, tests) == [1.0, 0.0, 2 / 3, 0.0, 1.0]
    assert code_execution_reward([block(SQUARE)], [None]) == [None], "a row without tests is unscorable"


def test_hostile_programs_score_zero_without_an_exception_and_are_counted(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_planted_code")
    monkeypatch.setattr(code_execution, "TIMEOUT_S", 5.0)
    before = code_execution.failures.copy()
    completions = [block(code) for code in HOSTILE.values()] + [block(SPY)]
    tests = [ASSERTS] * len(HOSTILE) + [[{"input": "", "output": "HF_TOKEN=hf_planted_code"}]]
    assert code_execution_reward(completions, tests) == [0.0] * len(completions)
    counted = code_execution.failures - before
    # hang: timeout; crash: killed (SIGSEGV); the disk flood: disk; the early exit and the forged line:
    # wrong (they exited 0 without the runner's token); the spy: wrong (it found nothing).
    assert counted["timeout"] >= 1 and counted["disk"] == 1 and counted["killed"] >= 1, counted
    assert counted["wrong"] >= 3, counted
    assert sum(counted.values()) == len(completions)
