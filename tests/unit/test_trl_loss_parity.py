"""Every loss_type x importance_sampling_level against TRL 1.16's own `_compute_loss`, on the same per-token
inputs (fp32; loss, gradient and shared metrics within 1e-6): tests/support/trl_loss_parity_check.py, run in a
process with the trl==1.16.0 wheel on its path. `make venv` installs TRL into a folder of its own
(Makefile, TRL_PARITY), never into the venv's site-packages: asyncgrpo does not depend on TRL, and a
test must not import it into the suite's own processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support_paths import SUPPORT

TESTS = SUPPORT
# Where `make venv` puts it; ASYNCGRPO_TRL_PARITY names another folder holding trl==1.16.0 (pip --target).
TRL_FOLDER = Path(os.environ.get("ASYNCGRPO_TRL_PARITY", Path(sys.prefix) / "trl-parity"))


def run_beside_trl(script: str) -> subprocess.CompletedProcess:
    """Run the check script `script` of tests/ in a process with TRL's folder on its path."""
    path = os.pathsep.join([str(TRL_FOLDER), str(TESTS.parents[1]), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(TESTS / script)],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_every_loss_type_and_ratio_level_matches_trls_own_code():
    assert (TRL_FOLDER / "trl" / "trainer" / "grpo_trainer.py").is_file(), (
        f"{TRL_FOLDER} does not hold TRL: run `make venv` (Makefile, TRL_PARITY)"
    )
    done = run_beside_trl("trl_loss_parity_check.py")
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines and lines[-1] == "parity", done.stdout + done.stderr[-4000:]
    assert "138 cases, 0 failed" in done.stdout, "every loss_type x level x setting must have run"
