"""Which kernels the packed layers run on CUDA, and the environment variables that override it.

Two parts of a Gated DeltaNet layer have a kernel of asyncgrpo's own beside another implementation:
- the path convolution + SiLU (`ASYNCGRPO_PATH_CONV`): "triton", asyncgrpo's kernel
  (`packing.tree_conv`, the default where Triton is installed); "fla", fla-core's varlen
  `causal_conv1d`; "conv1d", `F.conv1d` with the segment starts fixed up (the only path off CUDA);
- the gated RMS norm after the recurrence (`ASYNCGRPO_GATED_NORM`): "triton", asyncgrpo's fused
  kernel (`packing.gated_norm`, the default where Triton is installed); "model", the model's own
  module (eager torch ops).
Tree attention (`ASYNCGRPO_TREE_ATTENTION`): "triton", asyncgrpo's own kernels
(`packing/tree_attention_kernel.py`, the default where Triton is installed) for masks without a
sliding window and layers without softcapping; "flex", torch's FlexAttention over the BlockMask (what
every other case runs, and the only path off CUDA).
The variables are read at every call, so a benchmark can time both choices in one process; an
unknown value, or a kernel whose package is not installed, is a ValueError. Off CUDA they are
ignored. Why these defaults: docs/models.md, "Gated DeltaNet hybrids", and
docs/gpu-performance.md, "Tree attention".
"""

from __future__ import annotations

import functools
import importlib.util
import os

from asyncgrpo.errors import ConfigurationError

PATH_CONV_ENV = "ASYNCGRPO_PATH_CONV"
PATH_CONVS = ("triton", "fla", "conv1d")
GATED_NORM_ENV = "ASYNCGRPO_GATED_NORM"
GATED_NORMS = ("triton", "model")
TREE_ATTENTION_ENV = "ASYNCGRPO_TREE_ATTENTION"
TREE_ATTENTIONS = ("triton", "flex")
_PACKAGE_OF = {"triton": "triton", "fla": "fla"}  # the module a choice imports
_INSTALL = {"triton": "torch's CUDA builds bring it", "fla": "`pip install 'asyncgrpo[gpu]'` brings fla-core"}


@functools.cache
def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _choice(variable: str, choices: tuple[str, ...], device_type: str, fallback: str) -> str:
    """The choice for `variable` on a device of this type: the variable's value on CUDA when set, else
    "triton" where it is installed, else `fallback` (the only choice off CUDA)."""
    if device_type != "cuda":
        return fallback
    value = os.environ.get(variable, "").strip().lower()
    if not value:
        return "triton" if installed("triton") else fallback
    if value not in choices:
        raise ConfigurationError(f"{variable}={value!r}: choose one of {', '.join(choices)} (or unset it)")
    package = _PACKAGE_OF.get(value)
    if package is not None and not installed(package):
        raise ConfigurationError(
            f"{variable}={value}: {package} is not installed ({_INSTALL[package]}); unset it"
        )
    return value


def path_conv_choice(device_type: str) -> str:
    """Which path convolution the layers run on a device of this type (see the module doc)."""
    return _choice(PATH_CONV_ENV, PATH_CONVS, device_type, "conv1d")


def gated_norm_choice(device_type: str) -> str:
    """Which gated RMS norm the layers run on a device of this type (see the module doc)."""
    return _choice(GATED_NORM_ENV, GATED_NORMS, device_type, "model")


def tree_attention_choice(device_type: str) -> str:
    """Which tree attention the rows of a device of this type run (see the module doc)."""
    return _choice(TREE_ATTENTION_ENV, TREE_ATTENTIONS, device_type, "flex")
