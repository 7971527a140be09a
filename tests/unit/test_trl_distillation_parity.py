"""The distillation loss against TRL 1.16's own functions on the same fp32 tensors (loss, gradients and
metrics within 1e-6): tests/support/trl_distillation_parity_check.py, run in a process with the trl==1.16.0
wheel on its path, as tests/unit/test_trl_loss_parity.py runs the GRPO loss menu's check."""

from __future__ import annotations

import pytest
from test_trl_loss_parity import TRL_FOLDER, run_beside_trl


@pytest.mark.slow
def test_the_distillation_loss_matches_trls_own_code():
    trainer = TRL_FOLDER / "trl" / "experimental" / "async_distillation" / "async_distillation_trainer.py"
    assert trainer.is_file(), f"{TRL_FOLDER} does not hold TRL 1.16: run `make venv` (Makefile, TRL_PARITY)"
    done = run_beside_trl("trl_distillation_parity_check.py")
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines and lines[-1] == "parity", done.stdout + done.stderr[-4000:]
    assert "16 cases, 0 failed" in done.stdout, "every beta x tail x temperature case must have run"
