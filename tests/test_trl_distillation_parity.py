"""The distillation loss against TRL 1.16's own functions on the same fp32 tensors (loss, gradients and
metrics within 1e-6): tests/trl_distillation_parity_check.py, run in a process with the trl==1.16.0 wheel
on its path, as tests/test_trl_loss_parity.py runs the GRPO loss menu's check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# Where `make venv` puts it; ASYNCGRPO_TRL_PARITY names another folder holding trl==1.16.0 (pip --target).
TRL_FOLDER = Path(os.environ.get("ASYNCGRPO_TRL_PARITY", Path(sys.prefix) / "trl-parity"))


@pytest.mark.slow
def test_the_distillation_loss_matches_trls_own_code():
    trainer = TRL_FOLDER / "trl" / "experimental" / "async_distillation" / "async_distillation_trainer.py"
    assert trainer.is_file(), f"{TRL_FOLDER} does not hold TRL 1.16: run `make venv` (Makefile, TRL_PARITY)"
    path = os.pathsep.join([str(TRL_FOLDER), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(TESTS / "trl_distillation_parity_check.py")],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines and lines[-1] == "parity", done.stdout + done.stderr[-4000:]
    assert "16 cases, 0 failed" in done.stdout, "every beta x tail x temperature case must have run"
