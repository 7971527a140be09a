"""The harness needs no OpenEnv, yet works with OpenEnv's sessions, adapters and traces as they are:
tests/support/openenv_conformance_check.py checks its types against OpenEnv's in a process that can import
OpenEnv. OpenEnv cannot be installed beside vLLM (its fastmcp needs mcp < 2, vLLM mcp >= 2), so
`make venv` puts it in a folder of its own (Makefile), on that process's path only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support_paths import SUPPORT

TESTS = SUPPORT
OPENENV_FOLDER = Path(sys.prefix) / "openenv-conformance"


def test_the_harness_types_conform_to_openenvs():
    assert (OPENENV_FOLDER / "openenv").is_dir(), (
        f"{OPENENV_FOLDER} does not hold OpenEnv: run `make venv` (Makefile, OPENENV_PACKAGES)"
    )
    path = os.pathsep.join([str(OPENENV_FOLDER), str(TESTS.parents[1]), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(TESTS / "openenv_conformance_check.py")],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("conformant"), done.stdout + done.stderr
