"""What bounds the GPU tests' time (tests/conftest.py applies it where CUDA is available), so that
`pytest -m gpu` on a fresh machine ends within minutes (docs/gpu-performance.md, "GPU tests"):

- every Triton autotuner tries one config (bench/one_config_autotune's rule): the tests check values,
  not speed, and fla-core's autotuning of the gated delta rule alone took minutes on a fresh GPU
  machine, in fp32 more than one device call (bench/RESULTS.md);
- every GPU test gets a time limit (pytest-timeout, where installed), past which it fails with the
  stacks of its threads instead of holding the run: one hung in a child's wait until the device call
  ran out (issue 59).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

GPU_TEST_SECONDS = 300  # the longest GPU test (Qwen3.5-2B-shaped packed step vs fp32) takes ~60 s
_ONE_CONFIG = Path(__file__).resolve().parents[1] / "bench" / "one_config_autotune" / "sitecustomize.py"


def one_config_autotune() -> None:
    """Patch Triton's autotuner as bench/one_config_autotune does (before fla-core is imported)."""
    spec = importlib.util.spec_from_file_location("asyncgrpo_tests_one_config_autotune", _ONE_CONFIG)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def bound_gpu_tests(items) -> None:
    """A time limit on each GPU test that has none of its own."""
    for item in items:
        if "gpu" in item.keywords and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(GPU_TEST_SECONDS))
