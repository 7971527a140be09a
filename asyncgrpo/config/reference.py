"""Config fields of the KL term to a reference policy: its coefficient `beta`, the bias correction, and
the reference's updates (TR-DPO's `sync_ref_model`). TRL 1.16 GRPOConfig's names and defaults.

The reference lives in the trainer: with LoRA it is the base model (the adapter off, no second model);
otherwise a frozen copy of the initial model. docs/algorithm.md says why (measured against scoring it on a
vLLM server) and what it costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ReferenceFields:
    """The KL penalty to a reference model."""

    beta: float = field(
        default=0.0,
        metadata={
            "help": "KL coefficient: the loss adds beta x KL(policy || reference) per token (k3 estimator). "
            "0: no reference is kept and no reference forward runs (TRL's default); DeepSeek-R1 used 0.001."
        },
    )
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={
            "help": "Multiply each token's KL by its importance ratio (policy / sampler), so that its "
            "gradient is the unbiased reverse-KL gradient for tokens the sampler drew (DeepSeek-V3.2). "
            "True: TRL's default."
        },
    )
    sync_ref_model: bool = field(
        default=False,
        metadata={
            "help": "Every ref_model_sync_steps optimizer steps, move the reference toward the policy: "
            "ref = alpha x policy + (1 - alpha) x ref (TR-DPO). Needs beta > 0 and a reference copy (not "
            "LoRA, where the reference is the base model). False: TRL's default, a fixed reference."
        },
    )
    ref_model_mixup_alpha: float = field(
        default=0.6,
        metadata={
            "help": "TR-DPO's alpha: the policy's share (a fraction) in each reference update (TRL's "
            "default 0.6)."
        },
    )
    ref_model_sync_steps: int = field(
        default=512,
        metadata={"help": "TR-DPO's tau: optimizer steps between reference updates (TRL's default 512)."},
    )

    def _validate_reference(self, fail) -> None:
        if self.beta < 0:
            fail(f"beta={self.beta} must be >= 0 (0: no KL term)")
        if self.sync_ref_model and self.beta == 0:
            fail(
                "sync_ref_model=True with beta=0: the reference is not used, so there is nothing to update; "
                "set beta > 0 or sync_ref_model=False"
            )
        if not 0.0 <= self.ref_model_mixup_alpha <= 1.0:
            fail(f"ref_model_mixup_alpha={self.ref_model_mixup_alpha} must be in [0, 1]")
        if self.ref_model_sync_steps < 1:
            fail(f"ref_model_sync_steps={self.ref_model_sync_steps} must be >= 1")
