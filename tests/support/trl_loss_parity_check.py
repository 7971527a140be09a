"""Our loss types against TRL 1.16's own `GRPOTrainer._compute_loss` (tests/unit/test_trl_loss_parity.py runs
this in a process with the trl==1.16.0 wheel on its path: `make venv` installs it into its own folder).

TRL's loss is a trainer method that reads a few attributes and calls `_get_per_token_logps_and_entropies`
for the policy's log-probs. The trainer is built with `__new__` (no model, no dataset, no server), given
exactly the attributes that method reads, and its log-prob method returns the test's leaf tensors: the
formula that runs is TRL's own code, unchanged. Both sides get the same per-token inputs, in fp32:

- TRL, padded (B, T): the policy's log-probs, old = sampling log-probs = the sampler's (the old policy is
  the sampler, as in asyncgrpo), the advantages, the reference's log-probs, the entropies, and as
  `importance_sampling_ratio` the correction factor our off-policy correction gives (losses/ratios.py);
- ours, flat (one entry per trained token, `entry_sample` naming its sequence): the same values.

For every loss_type x importance_sampling_level, under settings that exercise each part (masking and
reweighting corrections, two-sided clipping, the KL with its bias correction, the high-entropy mask, the
entropy bonus, gradient accumulation), the loss and its gradient with respect to the log-probs and the
entropies must agree within 1e-6, and the metrics both log under the same name must agree too.
Prints one line per case and "parity" when every case holds.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from collections import defaultdict
from types import SimpleNamespace

import torch

warnings.filterwarnings("ignore")  # TRL's vLLM-version notice
from accelerate import Accelerator  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

from asyncgrpo.config.algorithm import LOSS_TYPES  # noqa: E402
from asyncgrpo.losses import AlgorithmSettings, LossTotals, algorithm_loss  # noqa: E402
from asyncgrpo.losses.off_policy import CorrectionSettings, correct  # noqa: E402
from asyncgrpo.losses.policy_loss import LossInputs  # noqa: E402
from asyncgrpo.losses.ratios import correction_factor, log_importance_weights  # noqa: E402
from asyncgrpo.losses.regularizers import entropy_threshold, high_entropy_mask  # noqa: E402

TOLERANCE = 1e-6
LENGTHS = [5, 3, 7, 1, 6]  # trained tokens of each sequence (B = 5, T = 7)
MAX_COMPLETION_LENGTH = 8
# Metrics both trainers log under one name (TRL's min/max extremes read per-sequence shares as ours do).
SHARED_METRICS = (
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
    "cispo_clip_ratio",
    "vespo/phi_seq_mean",
)

CASES = {
    # name: (correction mode or None for no correction, settings)
    "icepop": ("icepop", {}),
    "token_mask": ("token_mask", {}),
    "token_truncate": ("token_truncate", {}),
    "sequence_mask": ("sequence_mask", {}),
    "sequence_truncate": ("sequence_truncate", {}),
    "sequence_geometric_mask": ("sequence_geometric_mask", {}),
    # DeepSeek-V3.2's off-policy sequence mask: ours folds it into the correction's keep mask, TRL applies
    # its own `get_off_policy_mask`; TRL is given the factor without it.
    "off_policy_mask": ("icepop", {"off_policy_mask_threshold": 0.05}),
    "kl_entropy_accumulation": (
        None,
        {"beta": 0.04, "entropy_coef": 0.01, "top_entropy_quantile": 0.5, "delta": 1.5, "accumulation": 2},
    ),
    "kl_without_bias_correction": (None, {"beta": 0.1, "use_bias_correction_kl": False}),
}
# VESPO folds token weights only (TRL refuses sequence-level corrections with it).
SKIP = {("vespo", mode) for mode in ("sequence_mask", "sequence_truncate", "sequence_geometric_mask")}


def inputs(seed: int):
    """Per-token values (B, T) with a mask, and advantages (B,), drawn so that some ratios leave the
    correction's band and some leave the trust region."""
    generator = torch.Generator().manual_seed(seed)
    batch, width = len(LENGTHS), max(LENGTHS)
    mask = torch.zeros(batch, width)
    for row, length in enumerate(LENGTHS):
        mask[row, :length] = 1
    sampler = -torch.rand(batch, width, generator=generator) * 3 - 0.05
    logprobs = sampler + torch.randn(batch, width, generator=generator) * 0.5
    logprobs = torch.minimum(logprobs, torch.full_like(logprobs, -1e-3))
    reference = sampler + torch.randn(batch, width, generator=generator) * 0.2
    entropies = torch.rand(batch, width, generator=generator) * 2
    advantages = torch.tensor([1.3, -0.7, 0.4, -1.1, 0.0])
    return mask, sampler, logprobs, reference, entropies, advantages


def flat(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return values[mask.bool()]


def ours(case: str, loss_type: str, level: str, data) -> tuple[torch.Tensor, dict, list, torch.Tensor]:
    """(loss, metrics, [grad of log-probs, grad of entropies] as (B, T), the correction factor (B, T))."""
    mode, options = CASES[case]
    mask, sampler, logprobs, reference, entropies, advantages = data
    entry_sample = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    leaf = flat(logprobs, mask).clone().requires_grad_(True)
    entropy_leaf = flat(entropies, mask).clone().requires_grad_(True)
    correction = CorrectionSettings(
        enabled=mode is not None,
        mode=mode or "icepop",
        clip_min=0.5,
        clip_max=2.0,
        off_policy_mask_threshold=options.get("off_policy_mask_threshold"),
    )
    policy_mask = None
    if options.get("top_entropy_quantile", 1.0) < 1.0:
        threshold = entropy_threshold(entropy_leaf, options["top_entropy_quantile"])
        policy_mask = high_entropy_mask(entropy_leaf, threshold)
    x = LossInputs(
        logprobs=leaf,
        sampler_logprobs=flat(sampler, mask),
        advantages=advantages[entry_sample],
        entry_sample=entry_sample,
        entropy=entropy_leaf,
        num_samples=len(LENGTHS),
        ref_logprobs=flat(reference, mask),
        policy_mask=policy_mask,
    )
    accumulation = options.get("accumulation", 1)
    tokens = float(sum(LENGTHS))
    totals = LossTotals(
        step_trained_tokens=tokens * 2.5 if accumulation > 1 else tokens,  # the step's other micro-batch
        step_samples=float(len(LENGTHS) * accumulation),
        step_rows=accumulation,
        microbatch_trained_tokens=tokens,
        gradient_accumulation_steps=accumulation,
        max_completion_length=MAX_COMPLETION_LENGTH,
    )
    settings = AlgorithmSettings(
        loss_type=loss_type,
        score_centering=False,
        correction=correction,
        epsilon=0.2,
        epsilon_high=0.28 if loss_type != "cispo" else 1.5,
        importance_sampling_level=level,
        delta=options.get("delta"),
        beta=options.get("beta", 0.0),
        use_bias_correction_kl=options.get("use_bias_correction_kl", True),
        entropy_bonus=options.get("entropy_coef", 0.0) != 0.0,
        entropy_coef=options.get("entropy_coef", 0.0),
    )
    loss, metrics = algorithm_loss(x, settings, totals)
    loss.backward()
    # The factor TRL gets as its importance_sampling_ratio: what our correction gives for these inputs.
    without_mask = dataclasses.replace(correction, off_policy_mask_threshold=None)  # TRL applies its own
    c = correct(x.logprobs, x.sampler_logprobs, x.advantages, entry_sample, len(LENGTHS), without_mask)
    log_ratio = (x.logprobs - x.sampler_logprobs).detach()
    ratio = torch.exp(log_importance_weights(log_ratio, entry_sample, len(LENGTHS), level))
    factor = torch.ones_like(mask)
    factor[mask.bool()] = correction_factor(c, ratio)
    grads = []
    for grad in (leaf.grad, entropy_leaf.grad):
        padded = torch.zeros_like(mask)
        if grad is not None:
            padded[mask.bool()] = grad
        grads.append(padded)
    values = {name: stat.result() for name, stat in metrics.items()}
    return loss.detach(), {k: float(v) for k, v in values.items()}, grads, factor


def trl(case: str, loss_type: str, level: str, data, factor: torch.Tensor):
    """TRL 1.16's `_compute_loss` on the same inputs: (loss, metrics, grads as (B, T))."""
    _, options = CASES[case]
    mask, sampler, logprobs, reference, entropies, advantages = data
    leaf = logprobs.clone().requires_grad_(True)
    entropy_leaf = entropies.clone().requires_grad_(True)
    accumulation = options.get("accumulation", 1)
    entropy_coef = options.get("entropy_coef", 0.0)
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.args = SimpleNamespace(
        delta=options.get("delta"),
        use_bias_correction_kl=options.get("use_bias_correction_kl", True),
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
        vespo_k_pos=2.0,
        vespo_lambda_pos=3.0,
        vespo_k_neg=3.0,
        vespo_lambda_neg=2.0,
        steps_per_generation=accumulation,
        entropy_target=0.2,
    )
    trainer.accelerator = Accelerator(cpu=True)
    trainer.model = SimpleNamespace(training=True)
    trainer.loss_type = loss_type
    trainer.importance_sampling_level = level
    trainer.epsilon_low = 0.2
    trainer.epsilon_high = 0.28 if loss_type != "cispo" else 1.5
    trainer.beta = options.get("beta", 0.0)
    trainer.top_entropy_quantile = options.get("top_entropy_quantile", 1.0)
    trainer.off_policy_mask_threshold = options.get("off_policy_mask_threshold")
    trainer.use_vllm = True
    trainer.vllm_importance_sampling_correction = True
    trainer.current_gradient_accumulation_steps = accumulation
    trainer.max_completion_length = MAX_COMPLETION_LENGTH
    trainer.aux_loss_enabled = False
    trainer.entropy_coef = entropy_coef
    trainer.use_adaptive_entropy = False
    trainer._entropy_bonus_enabled = entropy_coef != 0.0
    trainer._last_world_entropy = math.inf
    trainer._entropy_window_stats = None
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (leaf, entropy_leaf, None)
    tokens = float(sum(LENGTHS))
    batch = {
        "prompt_ids": torch.zeros(len(LENGTHS), 1, dtype=torch.long),
        "prompt_mask": torch.ones(len(LENGTHS), 1, dtype=torch.long),
        "completion_ids": torch.zeros_like(mask, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": sampler,
        "sampling_per_token_logps": sampler,
        "importance_sampling_ratio": factor,
        "ref_per_token_logps": reference,
        "num_items_in_batch": torch.tensor(tokens * 2.5 if accumulation > 1 else tokens),
    }
    loss = trainer._compute_loss(None, batch)
    loss.backward()
    grads = [leaf.grad * mask, (entropy_leaf.grad if entropy_leaf.grad is not None else 0 * mask) * mask]
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return loss.detach(), metrics, grads


def coverage(case: str, metrics: dict, grads: list, factor: torch.Tensor, seen: set) -> None:
    """What the inputs exercised (a case that masks nothing cannot test the masking)."""
    mask = torch.tensor([[col < length for col in range(max(LENGTHS))] for length in LENGTHS])
    if (factor[mask] == 0).any():
        seen.add("masked tokens")
    if ((factor[mask] > 0) & (factor[mask] != 1)).any():
        seen.add("reweighted tokens")
    if metrics.get("clip_ratio/low_mean", 0) > 0 and metrics.get("clip_ratio/high_mean", 0) > 0:
        seen.add("clipped low and high")
    if metrics.get("cispo_clip_ratio", 0) > 0:
        seen.add("cispo clipped")
    if metrics.get("sampling/masked_sequences/off_policy", 0) > 0:
        seen.add("off-policy sequences masked")
    if grads[1].abs().sum() > 0:
        seen.add("entropy gradient")
    if "kl" in metrics:
        seen.add("kl")


EXERCISED = {
    "masked tokens",
    "reweighted tokens",
    "clipped low and high",
    "cispo clipped",
    "off-policy sequences masked",
    "entropy gradient",
    "kl",
}


def main() -> int:
    failures = 0
    cases = 0
    seen: set[str] = set()
    for seed, case in enumerate(CASES):
        data = inputs(seed)
        for loss_type in LOSS_TYPES:
            for level in ("token", "sequence"):
                if (loss_type, CASES[case][0]) in SKIP:
                    continue
                cases += 1
                our_loss, our_metrics, our_grads, factor = ours(case, loss_type, level, data)
                trl_loss, trl_metrics, trl_grads = trl(case, loss_type, level, data, factor)
                coverage(case, our_metrics, our_grads, factor, seen)
                loss_error = abs(float(our_loss) - float(trl_loss))
                grad_error = max(float((a - b).abs().max()) for a, b in zip(our_grads, trl_grads))
                shared = [name for name in SHARED_METRICS if name in trl_metrics]
                missing = [name for name in shared if name not in our_metrics]
                metric_error = max(
                    [abs(our_metrics[n] - trl_metrics[n]) for n in shared if n in our_metrics] or [0.0]
                )
                ok = loss_error <= TOLERANCE and grad_error <= TOLERANCE and metric_error <= TOLERANCE
                ok = ok and not missing
                failures += not ok
                print(
                    f"{'ok ' if ok else 'BAD'} {case:<26} {loss_type:<8} {level:<8} "
                    f"loss {float(trl_loss):+.6f} "
                    f"|d loss| {loss_error:.1e} |d grad| {grad_error:.1e} |d metrics| {metric_error:.1e} "
                    f"metrics {','.join(shared)}" + (f" MISSING {missing}" if missing else "")
                )
    print(f"{cases} cases, {failures} failed; exercised: {', '.join(sorted(seen))}")
    if failures or EXERCISED - seen:
        print(f"not exercised: {sorted(EXERCISED - seen)}")
        return 1
    print("parity")
    return 0


if __name__ == "__main__":
    sys.exit(main())
