"""What an agent process is started with of the machine: a minimal environment, and how many agents
run at once.

The environment: an agent is a program the policy drives, and what RL finds first is whatever raises
the reward. The trainer's environment holds what such a program must never have: the Hub and
experiment-tracker tokens, cloud credentials, the server's API key, and torchrun's rendezvous
(`MASTER_ADDR`, `RANK`, ...: a distributed script the agent runs would join the trainer's). So an
agent gets the few variables a program needs to run (where programs are, its home, its locale), a
temporary folder of its own, the session's `OPENAI_*` variables, and what the user passes in `env`;
nothing else of the trainer's.

How many agents: each is a process (a Python agent: an interpreter, its imports, its memory), so
without a bound a run starts as many as rollouts may run at once, far more than a small machine
can start at the same time. The default is what the machine can hold: a few agents per core (an
agent mostly waits on the model), no more than the memory available holds.
"""

from __future__ import annotations

import os
from pathlib import Path

# The trainer's variables an agent keeps: what any program needs to find programs, its home and its locale.
INHERITED_VARIABLES = ("PATH", "HOME", "LANG", "LANGUAGE")
INHERITED_PREFIXES = ("LC_",)
# Agents per core by default: an agent spends most of its time waiting on the model's replies.
AGENTS_PER_CORE = 4
# The memory one agent is assumed to take, for the default bound: a Python interpreter with an HTTP
# client library and room for the agent's own work.
AGENT_MEMORY_BYTES = 256 * 2**20


def agent_environment(
    temp_dir: Path | str,
    user_env: dict[str, str],
    openai_variables: dict[str, str],
    home: str | None = None,
) -> dict[str, str]:
    """The agent's whole environment: the inherited few (`HOME` replaced by `home` when given: a
    sandboxed agent's own), `TMPDIR`/`TMP`/`TEMP` at its own temporary folder, the user's `env`, and
    last the session's `OPENAI_*` (which nothing may override)."""
    inherited = {
        name: value
        for name, value in os.environ.items()
        if name in INHERITED_VARIABLES or name.startswith(INHERITED_PREFIXES)
    }
    if home is not None:
        inherited["HOME"] = home
    temp = str(temp_dir)
    return {**inherited, "TMPDIR": temp, "TMP": temp, "TEMP": temp, **user_env, **openai_variables}


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (what can be used without swapping), or None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_max_agents() -> int:
    """How many agents this machine runs at once by default: AGENTS_PER_CORE per usable core, at most
    the available memory over AGENT_MEMORY_BYTES, at least 1."""
    bound = AGENTS_PER_CORE * usable_cores()
    memory = available_memory_bytes()
    if memory is not None:
        bound = min(bound, memory // AGENT_MEMORY_BYTES)
    return max(1, int(bound))
