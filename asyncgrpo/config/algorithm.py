"""Config fields of TRL's GRPO loss menu: which loss (`loss_type`), its ratio (token or sequence), each
loss's own parameters, and the entropy terms (the high-entropy token mask and the entropy bonus).

Names and semantics are TRL 1.16 `GRPOConfig`'s. One default differs: `loss_type=None` keeps asyncgrpo's
score-centered loss (TRL's default is "dapo"). docs/algorithm.md gives every formula.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncgrpo.config.correction_modes import ICEPOP, TOKEN_MASK, TOKEN_TRUNCATE
from asyncgrpo.config.trl_compat import warn_once

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
# The loss types whose objective is GRPO's clipped surrogate (they differ in how they normalize).
CLIPPED_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "luspo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# VESPO folds the correction's per-token weights into its sequence weight: token-level modes only (TRL's
# rule; `icepop` is token masking, as token_mask).
VESPO_CORRECTION_MODES = (ICEPOP, TOKEN_MASK, TOKEN_TRUNCATE)


@dataclass
class AlgorithmFields:
    """The policy loss TRL's users pick by name (DAPO, Dr. GRPO, GSPO, CISPO, SAPO, LUSPO, VESPO)."""

    loss_type: str | None = field(
        default=None,
        metadata={
            "help": "TRL's loss: 'grpo' (per-sequence mean), 'dr_grpo' (sum / (sequences x "
            "max_completion_length)), 'dapo' (token mean over the step), 'bnpo' (token mean over a row), "
            "'cispo' (clipped, detached ratio x log p), 'sapo' (soft sigmoid gate), 'luspo' (per-sequence "
            "sum), 'vespo' (gamma-weighted sequence ratio), each exactly TRL's formula with the sampler as "
            "the old policy. None: asyncgrpo's score-centered loss (score_centering=True) or its clipped "
            "loss (score_centering=False), unchanged. TRL's default is 'dapo'."
        },
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={
            "help": "'token': one ratio per token; 'sequence': each sequence's ratio is the geometric mean "
            "of its token ratios (GSPO; use with loss_type='grpo'). Needs a loss_type. 'token': TRL's "
            "default."
        },
    )
    delta: float | None = field(
        default=None,
        metadata={
            "help": "Two-sided clipping (INTELLECT-2): the clipped loss types also cap the ratio at delta. "
            "None: off (TRL's default); recommended above 1 + epsilon_high."
        },
    )
    sapo_temperature_neg: float = field(
        default=1.05,
        metadata={"help": "SAPO's gate temperature for tokens with advantage <= 0 (TRL's default 1.05)."},
    )
    sapo_temperature_pos: float = field(
        default=1.0,
        metadata={"help": "SAPO's gate temperature for tokens with advantage > 0 (TRL's default 1.0)."},
    )
    vespo_k_pos: float = field(
        default=2.0,
        metadata={
            "help": "VESPO's power k for advantages >= 0: how hard a low sequence ratio is damped. 2.0: "
            "TRL's."
        },
    )
    vespo_lambda_pos: float = field(
        default=3.0,
        metadata={
            "help": "VESPO's decay lambda for advantages >= 0: how hard a high sequence ratio is damped. "
            "3.0: TRL's."
        },
    )
    vespo_k_neg: float = field(
        default=3.0,
        metadata={
            "help": "VESPO's power k (an exponent of the sequence ratio) for advantages < 0. 3.0: TRL's."
        },
    )
    vespo_lambda_neg: float = field(
        default=2.0,
        metadata={
            "help": "VESPO's decay lambda (a factor of the sequence ratio) for advantages < 0. 2.0: TRL's."
        },
    )
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={
            "help": "Keep in the policy loss only the tokens whose entropy is in the top quantile of the "
            "micro-batch (Beyond the 80/20 Rule; the paper uses 0.2). 1.0: every token (TRL's default)."
        },
    )
    entropy_coef: float = field(
        default=0.0,
        metadata={
            "help": "Entropy bonus: the loss subtracts entropy_coef x the mean entropy of the trained "
            "tokens, whatever the loss type. With use_adaptive_entropy, the starting coefficient. 0: off."
        },
    )
    use_adaptive_entropy: bool = field(
        default=False,
        metadata={
            "help": "Skywork-OR1's adaptive coefficient: after each step, entropy_coef moves by "
            "entropy_coef_delta toward more bonus when the step's entropy is at or below entropy_target, "
            "less otherwise, and the bonus applies only while the entropy is at or below the target. False: "
            "TRL's default."
        },
    )
    entropy_coef_min: float = field(
        default=0.0, metadata={"help": "Lower bound of the adaptive coefficient. 0.0: TRL's."}
    )
    entropy_coef_max: float = field(
        default=1.0, metadata={"help": "Upper bound of the adaptive coefficient. 1.0: TRL's."}
    )
    entropy_coef_delta: float = field(
        default=0.005,
        metadata={"help": "Step of the adaptive coefficient at each optimizer step. 0.005: TRL's."},
    )
    entropy_target: float = field(
        default=0.2,
        metadata={
            "help": "Entropy (nats per token) at or below which the adaptive bonus applies. 0.2 (TRL's) "
            "almost never triggers; set it near the entropy logged early in the run."
        },
    )

    def _resolve_algorithm(self) -> None:
        """score_centering=None means True when no loss_type is given (asyncgrpo's default loss)."""
        if self.score_centering is None:
            self.score_centering = self.loss_type is None

    def _validate_algorithm(self, fail) -> None:
        if self.loss_type is not None and self.loss_type not in LOSS_TYPES:
            fail(f"loss_type={self.loss_type!r} is not a loss: pick one of {', '.join(LOSS_TYPES)}, or None")
        if self.loss_type is not None and self.score_centering:
            fail(
                f"score_centering=True and loss_type={self.loss_type!r} each pick a loss: leave "
                "score_centering unset to train with the loss_type, or drop loss_type for score centering"
            )
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            fail(
                f"importance_sampling_level={self.importance_sampling_level!r} must be 'token' or 'sequence'"
            )
        if self.importance_sampling_level == "sequence" and self.loss_type is None:
            fail(
                "importance_sampling_level='sequence' needs a loss_type (GSPO: loss_type='grpo'); the "
                "score-centered and clipped losses of asyncgrpo use token ratios"
            )
        self._validate_loss_parameters(fail)
        self._validate_entropy(fail)
        self._warn_as_trl()

    def _validate_loss_parameters(self, fail) -> None:
        if self.delta is not None and not self.delta > 0:
            fail(
                f"delta={self.delta} must be > 0 (a cap on the ratio; TRL suggests > 1 + epsilon_high), "
                "or None"
            )
        if not (self.sapo_temperature_neg > 0 and self.sapo_temperature_pos > 0):
            fail(
                "sapo_temperature_neg and sapo_temperature_pos must be > 0 (the gate divides by them), got "
                f"{self.sapo_temperature_neg} and {self.sapo_temperature_pos}"
            )
        vespo = (self.vespo_k_pos, self.vespo_lambda_pos, self.vespo_k_neg, self.vespo_lambda_neg)
        if min(vespo) < 0:
            fail(f"vespo_k_pos, vespo_lambda_pos, vespo_k_neg and vespo_lambda_neg must be >= 0, got {vespo}")
        if (
            self.loss_type == "vespo"
            and self.vllm_importance_sampling_correction
            and self.vllm_importance_sampling_mode not in VESPO_CORRECTION_MODES
        ):
            fail(
                f"loss_type='vespo' folds the correction's token weights into its sequence weight: "
                f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} must be one of "
                f"{', '.join(VESPO_CORRECTION_MODES)} (or vllm_importance_sampling_correction=False)"
            )

    def _validate_entropy(self, fail) -> None:
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            fail(f"top_entropy_quantile={self.top_entropy_quantile} must be in [0, 1] (1.0: every token)")
        if self.use_adaptive_entropy:
            if self.entropy_coef_min > self.entropy_coef_max:
                fail(
                    f"entropy_coef_min={self.entropy_coef_min} must be <= "
                    f"entropy_coef_max={self.entropy_coef_max}"
                )
            if self.entropy_coef_delta < 0 or self.entropy_target < 0:
                fail("entropy_coef_delta and entropy_target must be >= 0")

    def _warn_as_trl(self) -> None:
        """Where TRL's trainer warns, so does this one (once per process)."""
        level = self.importance_sampling_level
        if self.loss_type == "luspo" and level != "sequence":
            warn_once(
                "luspo_level",
                "loss_type='luspo' with importance_sampling_level='token': LUSPO's paper uses sequence "
                "ratios; set importance_sampling_level='sequence' to mirror it",
            )
        if self.loss_type == "vespo" and level != "token":
            warn_once(
                "vespo_level",
                "loss_type='vespo' computes its sequence weight itself: importance_sampling_level should be "
                "'token' (the default)",
            )
        if level == "sequence" and self.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            warn_once(
                "sequence_level_token_sum",
                f"importance_sampling_level='sequence' with loss_type={self.loss_type!r} sums per-token "
                "terms, which weighs each sequence by its length; GSPO's setup is loss_type='grpo'",
            )
        if self.delta is not None and self.loss_type not in CLIPPED_LOSS_TYPES:
            warn_once(
                "delta",
                f"delta={self.delta} has no effect with loss_type={self.loss_type!r}: only "
                f"{', '.join(CLIPPED_LOSS_TYPES)} clip the ratio",
            )
