"""Code that runs inside vLLM's worker processes (`--worker-extension-cls`), never in the trainer.

vLLM's in-place weight reload (`reload_weights`) loads a layer's new weights into fresh tensors, runs
the layer's post-load processing on them and copies the result into the tensors the kernels read.
For an unquantized fused-MoE layer that processing skips one step on every load after the first: it
sees the layer's kernel already built, takes the load for a weight update, and leaves out the
experts' own post-load step, which on CPU repacks `w13_weight` and `w2_weight` into the grouped-GEMM
layout of vLLM's CPU MoE kernel (`CPUUnquantizedExperts.process_weights_after_loading`, vLLM 0.32).
The kernel then reads checkpoint-layout weights as if they were packed, and a Qwen3-MoE server's
log-probs drift from the trainer's after the first weight sync, even for the very same weights
(docs/models.md). GPU kernels need no such step, so only CPU servers are affected.

`WorkerExtension.asyncgrpo_reload_weights` is vLLM's reload with that kernel forgotten first: each
fused-MoE layer then takes the path it took at start-up (repacking included) and builds its kernel
anew from the reloaded weights. `asyncgrpo serve` adds the extension for a mixture-of-experts model
on CPU; the client calls this method instead of `reload_weights` on a server that runs it.
"""

from __future__ import annotations

# What `--worker-extension-cls` names, and the collective_rpc method it adds.
WORKER_EXTENSION = f"{__name__}.WorkerExtension"
RELOAD_METHOD = "asyncgrpo_reload_weights"


class WorkerExtension:
    """Mixed into vLLM's worker class by vLLM itself; `self` is the worker."""

    def asyncgrpo_reload_weights(self, weights_path: str) -> None:
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )

        methods = [
            module.quant_method
            for module in self.model_runner.get_model().modules()
            if isinstance(getattr(module, "quant_method", None), UnquantizedFusedMoEMethod)
        ]
        kernels = [method.moe_kernel for method in methods]
        for method in methods:
            method.moe_kernel = None  # the reload's post-load processing repacks and rebuilds it
        try:
            self.reload_weights(weights_path=weights_path)
        finally:
            for method, kernel in zip(methods, kernels):
                if method.moe_kernel is None:  # the reload failed before reaching this layer
                    method.moe_kernel = kernel
