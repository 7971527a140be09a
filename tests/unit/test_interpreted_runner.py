"""tests/support/interpreted.py, the runner of the Triton check scripts: a script that runs past its bound
fails the calling test with what it printed (a GPU run once sat in a child's wait until the device
call ran out, and nothing said where: bench/RESULTS.md, issue 59)."""

from __future__ import annotations

import subprocess

import interpreted
import pytest


def test_a_script_past_its_bound_fails_with_what_it_printed(monkeypatch):
    def stopped(command, **options):
        printed = {"output": b"kernel 3 of 5\n", "stderr": b"ptxas\n"}
        raise subprocess.TimeoutExpired(command, options["timeout"], **printed)

    monkeypatch.setattr(interpreted.subprocess, "run", stopped)
    monkeypatch.setattr(interpreted, "triton_for_the_interpreter", lambda: "")
    bound = interpreted.SCRIPT_SECONDS
    with pytest.raises(pytest.fail.Exception, match=f"(?s)ran past {bound} s.*kernel 3 of 5.*ptxas"):
        interpreted.run_interpreted("head_kernels_check.py")
