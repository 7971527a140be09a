"""`pytest -m gpu` must collect on a GPU host that has torch and transformers but not every
non-torch dependency (such a host lacked msgspec, datasets and vLLM): a test module that needs one
of them skips at import, naming it, instead of failing collection and with it the whole GPU run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What a GPU host was seen to lack (docs/gpu-performance.md, "GPU tests"); msgspec is the one the GPU
# runs carry (the fused head's trainer tests need it), so a host may lack the other two alone.
ABSENT_ON_GPU_HOSTS = ("msgspec", "datasets", "vllm")
ABSENT_WITH_MSGSPEC_CARRIED = ("datasets", "vllm")

# Runs pytest's collection in a fresh interpreter in which importing those packages fails as it
# would where they are not installed, and looking them up (`importlib.util.find_spec`, as
# transformers checks what is installed) finds nothing.
_COLLECT_WITHOUT = """
import importlib.abc, importlib.util, sys
import pytest

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {absent!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

looked_up = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: (
    None if name.split(".")[0] in {absent!r} else looked_up(name, package)
)
sys.meta_path.insert(0, Absent())
sys.exit(pytest.main(["--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("absent", [ABSENT_ON_GPU_HOSTS, ABSENT_WITH_MSGSPEC_CARRIED])
def test_gpu_tests_collect_without_the_packages_a_gpu_host_lacks(absent):
    result = subprocess.run(
        [sys.executable, "-c", _COLLECT_WITHOUT.format(absent=absent)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, f"collection failed without {absent}:\n{report[-4000:]}"
    assert "error" not in report.splitlines()[-1].lower(), report[-4000:]
    assert " collected" in report or "selected" in report, report[-2000:]
