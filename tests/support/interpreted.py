"""Running a Triton check script under Triton's interpreter, for the CPU tests of the CUDA kernels.

The interpreter runs a kernel's program in numpy over CPU tensors, so the kernels' logic is tested on
every CPU run (CI has no GPU); the GPU tests check their compiled code. TRITON_INTERPRET is read when
a kernel is defined, so each script runs in a process of its own.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# A bound against a hang, past the slowest script seen (the sm_90 compile check: 12-25 s on 2 loaded cores).
SCRIPT_SECONDS = 600


# The check scripts import helpers of the unit and GPU test modules by name.
TEST_FOLDERS = [str(Path(__file__).resolve().parents[1] / kind) for kind in ("unit", "gpu")]


def triton_for_the_interpreter() -> str | None:
    """Where Triton can be imported from: the environment itself (a GPU host, ""), or the folder
    `make venv` installs it into beside the venv's packages (CPU machines: in site-packages, vLLM
    and torch would take it for a usable GPU Triton); None if neither."""
    if importlib.util.find_spec("triton") is not None:
        return ""
    folder = Path(sys.prefix) / "triton-interpreter"
    return str(folder) if (folder / "triton").is_dir() else None


def run_interpreted(script_name: str, interpret: bool = True) -> str:
    """Run tests/`script_name` with TRITON_INTERPRET=1 (`interpret=False`: without it, for a script
    that only compiles kernels, which needs no GPU); its stdout. Fails the calling test (with what to
    do) when Triton is missing or the script fails."""
    folder = triton_for_the_interpreter()
    assert folder is not None, (
        f"Triton is not importable and {Path(sys.prefix) / 'triton-interpreter'} does not hold it: "
        "run `make venv` (it installs Triton there for the interpreted kernel tests)"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1" if interpret else "0"}
    env["PYTHONPATH"] = os.pathsep.join([*TEST_FOLDERS, env.get("PYTHONPATH", "")])
    if folder:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, env.get("PYTHONPATH")]))
    script = Path(__file__).with_name(script_name)
    try:
        done = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=SCRIPT_SECONDS
        )
    except subprocess.TimeoutExpired as stopped:  # what it printed says where it was
        tail = output_tail(stopped.stdout, stopped.stderr)
        pytest.fail(f"{script_name} ran past {SCRIPT_SECONDS} s:\n{tail}")
    assert done.returncode == 0, output_tail(done.stdout, done.stderr)
    return done.stdout


def output_tail(stdout: str | bytes | None, stderr: str | bytes | None) -> str:
    """The end of a child's stdout and stderr (a timed-out child's may be bytes, or None)."""
    text = [s.decode(errors="replace") if isinstance(s, bytes) else s or "" for s in (stdout, stderr)]
    return text[0][-2000:] + text[1][-4000:]
