"""Config fields of the loss: the trust region, score centering, the off-policy correction, and the
tokens one process forwards per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncgrpo.config.correction_modes import MODES as IS_MODES


@dataclass
class LossFields:
    """What the loss trains on and how it corrects for the sampler."""

    epsilon: float = field(
        default=0.2,
        metadata={
            "help": "Lower trust-region half-width: the clipped loss clips the ratio at 1 - epsilon (with "
            "score_centering it only defines the clip_ratio/* metrics). 0.2: PPO/GRPO's usual value."
        },
    )
    epsilon_high: float | None = field(
        default=None,
        metadata={
            "help": "Upper trust-region half-width (ratio clipped at 1 + epsilon_high); None: epsilon. DAPO "
            "suggests 0.28."
        },
    )
    score_centering: bool | None = field(
        default=None,
        metadata={
            "help": "With no loss_type: the score-centered loss (True) or asyncgrpo's clipped surrogate "
            "(False). None: True unless a loss_type is given. True: subtracting the sampler's expected score "
            "removes the pull toward the sampler that importance weighting leaves."
        },
    )
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "help": "Correct for the sampler being off-policy (stale weights, other kernels) with "
            "vllm_importance_sampling_mode. True: TRL's default; False: no token is masked or reweighted."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="icepop",
        metadata={
            "help": "How the trainer/sampler ratio exp(logp - sampler logp) corrects the loss: 'icepop' "
            "(a trained token whose ratio leaves [clip_min, clip_max] leaves the loss, no reweighting), "
            "TRL's 'token_truncate', 'token_mask', 'sequence_truncate', 'sequence_mask' (the ratio, of "
            "the token or the whole sequence, clipped or masked, weights the token), or "
            "'sequence_geometric_mask' (a sequence whose geometric-mean ratio leaves the band leaves the "
            "loss). docs/algorithm.md gives each formula. 'icepop': masking alone keeps a rare huge "
            "ratio from dominating a step and adds no variance."
        },
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=0.5,
        metadata={
            "help": "Lower bound C_min of the ratio: masking modes drop what falls below it, truncating "
            "modes raise it to C_min. None: no lower bound. 0.5: tolerate a 2x drop, mask what is "
            "likely a mismatch."
        },
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=5.0,
        metadata={
            "help": "Upper bound C_max of the ratio: masking modes drop what rises above it, truncating "
            "modes lower it to C_max. None: no upper bound. 5.0: a ratio can fall only to 0 but rise "
            "without bound; far above 1 it is more likely a mismatch than signal, and would dominate."
        },
    )
    off_policy_mask_threshold: float | None = field(
        default=None,
        metadata={
            "help": "Off-policy sequence masking (DeepSeek-V3.2, TRL's name): a sequence with a negative "
            "advantage whose mean per-token log q - log p (sampler minus trainer) exceeds it leaves the "
            "loss. None: off. TRL suggests values around 0.5."
        },
    )
    moe_routing_replay: bool = field(
        default=False,
        metadata={
            "help": "MoE routing replay: the trainer's forward sends each sampled sequence's tokens to the "
            "experts the server routed them to (a token near an expert tie can otherwise go elsewhere in "
            "the trainer, a mismatch no importance weight corrects). Needs a server started with "
            "`asyncgrpo serve --moe-routing-replay` (vLLM's --enable-return-routed-experts: GPU only in "
            "vLLM 0.32). False: the sample carries no routing, which saves its (tokens x layers x top_k) "
            "bytes on the queue."
        },
    )
    num_sampler_logprobs: int = field(
        default=8,
        metadata={
            "help": "Top log-probs the server returns per generated token, for score centering (0 with "
            "score_centering=False). More covers more of the sampler's mass (sampling/sampler_mass shows "
            "how much) but costs the server serialization; its --max-logprobs caps it. 8: TRL's default."
        },
    )
    token_budget: int | None = field(
        default=None,
        metadata={
            "help": "Tokens one process forwards per micro-batch (a row), shared prefixes counted once, and "
            "the row's loss entries (trained tokens, counted per sample); bounds peak memory. None: the "
            "server's max_model_len, so every sample fits. Longer samples are dropped. <= 0 (TRL's "
            "fixed-count mode): a row holds per_device_train_batch_size samples, still tree-packed, "
            "whatever their tokens (no memory bound)."
        },
    )

    def _resolve_loss(self) -> None:
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon

    def _validate_loss(self, fail) -> None:
        clip_min, clip_max = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if not 0 < (1 if clip_min is None else clip_min) <= 1 <= (1 if clip_max is None else clip_max):
            fail(
                "need 0 < vllm_importance_sampling_clip_min <= 1 <= vllm_importance_sampling_clip_max "
                f"(None: unbounded), got {clip_min} and {clip_max}"
            )
        if self.vllm_importance_sampling_mode not in IS_MODES:
            fail(
                f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} is not a mode: pick "
                f"one of {', '.join(IS_MODES)}"
            )
        if self.off_policy_mask_threshold is not None and self.off_policy_mask_threshold < 0:
            fail(
                f"off_policy_mask_threshold={self.off_policy_mask_threshold} must be >= 0 (a KL), or None "
                "to turn off-policy sequence masking off"
            )
        if self.epsilon < 0 or self.epsilon_high < 0:
            fail("epsilon and epsilon_high must be >= 0")
        if self.num_sampler_logprobs < 0:
            fail(f"num_sampler_logprobs={self.num_sampler_logprobs} must be >= 0")
        if self.score_centering and self.num_sampler_logprobs == 0:
            fail(
                "score_centering=True needs num_sampler_logprobs > 0 (the sampler's top tokens to center on)"
            )
        if self.token_budget is not None and 0 < self.token_budget < 16:
            fail(
                f"token_budget={self.token_budget} is too small to hold a sample: give >= 16 tokens, None "
                "(the server's max_model_len), or <= 0 for rows of per_device_train_batch_size samples"
            )
        if self.token_budget is not None and self.token_budget <= 0 and self.per_device_train_batch_size < 1:
            fail(
                f"per_device_train_batch_size={self.per_device_train_batch_size} must be >= 1: with "
                f"token_budget={self.token_budget} it is the number of samples in each process's row"
            )
