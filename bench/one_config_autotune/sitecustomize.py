"""Put this folder first on PYTHONPATH to give every Triton autotuner ONE config (the first with
num_warps=4, else the first), so each kernel compiles once and nothing is benchmarked.
`ONE_CONFIG_AUTOTUNE_EXCEPT=name1,name2` leaves the kernels whose name contains one of these
substrings fully autotuned (cheap ones, e.g. fla's `causal_conv1d` kernels: 16 configs, tuned once per
channel count).

Why it exists: on a fresh GPU machine fla-core autotunes each gated-delta-rule kernel over all its
configs the first time it runs, compiling every one; on the H200 image the rule's backward was still
compiling (Triton `make_ptx`, `chunk_gated_delta_rule_bwd_dhu`) after 85 s in bf16 and after 200 s in
fp32, on device calls of a few minutes each (bench/RESULTS.md). With one config the whole fla
path compiled in under a minute. Figures measured this way use untuned fla kernels: a lower bound on
fla's speed. Not for training runs: a long run pays the autotuning once and keeps the tuned kernels.
"""

import os

from triton.runtime import autotuner

_original_init = autotuner.Autotuner.__init__
_EXCEPT = [name for name in os.environ.get("ONE_CONFIG_AUTOTUNE_EXCEPT", "").split(",") if name]


def _one_config_init(self, fn, *args, **kwargs):
    _original_init(self, fn, *args, **kwargs)
    if any(name in getattr(fn, "__name__", "") for name in _EXCEPT):
        return
    picked = [c for c in self.configs if getattr(c, "num_warps", None) == 4] or self.configs
    self.configs = picked[:1]


autotuner.Autotuner.__init__ = _one_config_init
