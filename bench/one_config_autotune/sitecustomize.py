"""Put this folder first on PYTHONPATH to give every Triton autotuner ONE config (the first with
num_warps=4, else the first), so each kernel compiles once and nothing is benchmarked.

Why it exists: on a fresh GPU machine fla-core autotunes each gated-delta-rule kernel over all its
configs the first time it runs, compiling every one; on the H200 image the rule's backward was still
compiling (Triton `make_ptx`, `chunk_gated_delta_rule_bwd_dhu`) after 85 s in bf16 and after 200 s in
fp32, on device calls of a few minutes each (bench/RESULTS.md). With one config the whole fla
path compiled in under a minute. Figures measured this way use untuned fla kernels: a lower bound on
fla's speed. Not for training runs: a long run pays the autotuning once and keeps the tuned kernels.
"""

from triton.runtime import autotuner

_original_init = autotuner.Autotuner.__init__


def _one_config_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    picked = [c for c in self.configs if getattr(c, "num_warps", None) == 4] or self.configs
    self.configs = picked[:1]


autotuner.Autotuner.__init__ = _one_config_init
