"""Where fla-core's autotuning results and the compiled Triton kernels are kept between processes
(`asyncgrpo.packing.kernel_cache`): the environment as docs/models.md documents it."""

from __future__ import annotations

import logging
import os

import pytest

from asyncgrpo.packing import kernel_cache
from asyncgrpo.packing.kernel_cache import persist_kernel_autotuning


@pytest.fixture
def clean_environment(monkeypatch, tmp_path):
    """No cache variables set, and a home of its own; restored afterwards."""
    for name in ("TRITON_CACHE_DIR", "TRITON_HOME", "FLA_CACHE_RESULTS"):
        monkeypatch.setenv(name, "placeholder")  # recorded, so the test's own settings are undone
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def test_default_is_tritons_own_folder(clean_environment):
    """Unset: Triton's default, ~/.triton/cache, made explicit so that inductor does not move it to
    the temporary directory; fla keeps its results."""
    folder = persist_kernel_autotuning()
    assert folder == clean_environment / "home" / ".triton" / "cache" and folder.is_dir()
    assert os.environ["TRITON_CACHE_DIR"] == str(folder) and os.environ["FLA_CACHE_RESULTS"] == "1"


def test_triton_home_and_a_users_folder_are_kept(clean_environment, monkeypatch):
    monkeypatch.setenv("TRITON_HOME", str(clean_environment / "th"))
    assert persist_kernel_autotuning() == clean_environment / "th" / ".triton" / "cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(clean_environment / "mine"))
    assert persist_kernel_autotuning() == clean_environment / "mine"


def test_a_given_folder_wins(clean_environment, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(clean_environment / "mine"))
    folder = persist_kernel_autotuning(clean_environment / "run" / "kernels")
    assert folder == clean_environment / "run" / "kernels" and folder.is_dir()
    assert os.environ["TRITON_CACHE_DIR"] == str(folder)


def test_fla_results_switched_off_is_said(clean_environment, monkeypatch, caplog):
    monkeypatch.setenv("FLA_CACHE_RESULTS", "0")
    with caplog.at_level(logging.WARNING, logger=kernel_cache.__name__):
        persist_kernel_autotuning()
    assert os.environ["FLA_CACHE_RESULTS"] == "0"  # the user's choice stands
    assert len(caplog.records) == 1 and "autotunes its kernels again in every process" in caplog.text
