"""What bounds the GPU tests' time (tests/conftest.py applies it where CUDA is available), so that
`pytest -m gpu` on a fresh machine ends within minutes (docs/gpu-performance.md, "GPU tests"):

- every Triton autotuner tries one config (bench/one_config_autotune's rule): the tests check values,
  not speed, and fla-core's autotuning of the gated delta rule alone took minutes on a fresh GPU
  machine, in fp32 more than one device call (bench/RESULTS.md);
- every GPU test gets a time limit (pytest-timeout, where installed), past which it fails with the
  stacks of its threads instead of holding the run: one hung in a child's wait until the device call
  ran out (issue 59);
- in parallel workers (`make test-gpu`), each GPU test is a group of its own and the longest start
  first: what takes the time is compiling kernels (Triton's for fla-core, inductor's for the compiled
  layers), one CPU core per process, so tests compile side by side on the GPU machine's cores instead
  of one after another (in one process the whole run took more than 9 minutes on a fresh H100); the
  few tests that hold tens of GB of GPU memory share one group, so that they never run side by side.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# The longest GPU test seen (the fp32 case of the gated delta rule against each sample alone: fla-core's
# kernels compiled in fp32, one config each) took 255 s on a fresh H100, alone in its process.
GPU_TEST_SECONDS = 420
# The tests that took longest on a fresh machine (bench/RESULTS.md, issue 59), longest first: each one
# compiles kernels no other test shares (fla-core's at a dtype or head shape of its own, the compiled
# decoder layers), so they start first, side by side.
LONGEST_FIRST = (
    "test_tree_rule_equals_each_sample_alone",
    "test_trainer_logprobs_on_the_gpu_match_fp32",
    "test_cuda_defaults_loss_gradient_matches_reference",
    "test_qwen3_5_2b_packed_bf16_equals_alone",
    "test_cuda_defaults_packed_logprobs_match_each_sample_alone",
    "test_cuda_compiled_layers_run_the_kernels",
    "test_path_conv_on_this_gpu",
)
# The GPU tests that hold tens of GB at their peak: the Qwen3.5-2B model test (two fp32 copies of the
# model and several copies of its gradients), the tree-attention kernels against dense float64 scores
# over rows of 3,300 tokens (32 heads: 2.8 GB a score matrix, several kept for backward), the MoE
# experts at Qwen3-30B-A3B's shape. One xdist group, so they run one after another: with 8 workers
# on an 80 GB H100 the 2B test ran out of memory twice beside another worker holding 28-30 GB
# (bench/RESULTS.md, issue 59).
MEMORY_HEAVY = (
    "test_qwen3_5_2b_packed_bf16_equals_alone",
    "test_cuda_tree_attention_kernels_match_dense",
    "test_cuda_grouped_experts_match_the_loop_at_qwen3_30b_a3b_shape",
)
_ONE_CONFIG = Path(__file__).resolve().parents[2] / "bench" / "one_config_autotune" / "sitecustomize.py"


def one_config_autotune() -> None:
    """Patch Triton's autotuner as bench/one_config_autotune does (before fla-core is imported)."""
    spec = importlib.util.spec_from_file_location("asyncgrpo_tests_one_config_autotune", _ONE_CONFIG)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def bound_gpu_tests(items) -> None:
    """A time limit on each GPU test that has none of its own."""
    for item in items:
        if "gpu" in item.keywords and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(GPU_TEST_SECONDS))


def gpu_test_group(item: pytest.Item) -> str | None:
    """The xdist group of a GPU test in parallel workers: the memory-heavy ones together, any other
    alone; None for tests that are not GPU tests."""
    if "gpu" not in item.keywords:
        return None
    if getattr(item, "originalname", item.name) in MEMORY_HEAVY:
        return "gpu-memory-heavy"
    return f"{item.path.stem}::{item.name}"


def longest_first(item: pytest.Item) -> int:
    """Sort key: the known long GPU tests first, in `LONGEST_FIRST`'s order, then the rest."""
    name = getattr(item, "originalname", item.name)
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
