"""Reading a run's metrics (docs/front-door.md#the-diagnosis), as pure functions of its history.

Questions, each answered with a verdict, the evidence (metric, values, steps) and what to do:
which side is the bottleneck (the trainer waiting for samples against generation held back by
max_staleness), is the run still learning (groups without signal, rewards, duplicates and entropy,
read as trends against the reward range), and, when the run evaluated, does the held-out reward
follow the training reward. The thresholds are named constants below; they
are judgement calls, stated so a reader can disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from asyncgrpo.losses.off_policy import MISMATCH_KL_PRECISION_FLOOR
from asyncgrpo.report.history import History

# Bottleneck: the trainer "waits" when more than a fifth of its step time is rollout_wait_s. Generation
# is "held" when its backpressure waits average more than a fifth of a step per window, or when it
# waits in most windows (three in four) for at least a tenth of a step.
WAIT_SHARE_HIGH = 0.2
BACKPRESSURE_SHARE_HIGH = 0.2
BACKPRESSURE_FREQUENT, BACKPRESSURE_FREQUENT_SHARE = 0.75, 0.1
# Generation-bound at the user's limit: concurrency at 70% of max_concurrent_rollouts or more, with the
# KV cache under half full.
CONCURRENCY_AT_LIMIT, KV_BUSY = 0.7, 0.5
# Saturation: frac_zero_std_groups is "low" below 0.3 and "high" from 0.5; it "climbs" when the last
# third is 0.15 above the first third.
FRAC_LOW, FRAC_HIGH, FRAC_CLIMB = 0.3, 0.5, 0.15
# Positions in the reward range: the bottom and top quarters.
BOTTOM, TOP = 0.25, 0.75
# A reward trend is a change of at least 5% of the reward range between the first and last thirds.
REWARD_TREND = 0.05
# Duplicates: "near (G-1)/G" from 80% of it; "rising" by 0.1; entropy "falling" when it loses 20%.
DUPLICATE_JUMP, DUPLICATE_RISE, ENTROPY_FALL = 0.8, 0.1, 0.2
# Mismatch "grows" when the last third's mean is at least twice the first third's and above a floor
# below which the two agree to bf16 precision whatever its trend: a k3 of 1e-3 nats (a per-token
# log-prob gap of about 0.045), or that gap itself where an older run logged only the difference.
MISMATCH_GROWTH = 2.0
MISMATCH_FLOOR = {
    "sampling/mismatch_kl/mean": MISMATCH_KL_PRECISION_FLOOR,
    "sampling/sampling_logp_difference/mean": 0.045,
}


@dataclass
class Finding:
    question: str  # "bottleneck", "saturation", "duplicates" or "held_out"
    verdict: str  # a short name, e.g. "generation-bound"
    explanation: str
    action: str
    evidence: list[str] = field(default_factory=list)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _thirds(history: History, name: str) -> tuple[float, float, str, str]:
    """Means of the first and last thirds of `name`'s windows, and their step ranges as text."""
    steps, values = history.series(name)
    third = max(1, len(values) // 3)
    first, last = values[:third], values[-third:]
    return _mean(first), _mean(last), _step_range(steps[:third]), _step_range(steps[-third:])


def _step_range(steps: list[int]) -> str:
    if not steps:
        return "no steps"
    return f"step {steps[0]}" if steps[0] == steps[-1] else f"steps {steps[0]}-{steps[-1]}"


def _steady(history: History) -> History:
    """The windows after start-up: the first quarter of the run (at least the first window) dropped."""
    skip = max(1, len(history.records) // 4) if len(history.records) > 2 else 0
    return History(history.records[skip:], history.config)


# -- which side is the bottleneck -------------------------------------------------------------------


@dataclass(frozen=True)
class _Waits:
    """The waits of a run's steady part: the trainer's for samples, generation's (backpressure)."""

    step_s: float
    rollout_wait_s: float  # per step
    backpressure_s: float  # per window, counting 0 for the windows in which generation did not wait
    held_windows: float  # the share of windows in which generation waited

    @property
    def wait_share(self) -> float:
        return self.rollout_wait_s / self.step_s

    @property
    def held_share(self) -> float:
        return self.backpressure_s / self.step_s

    @property
    def waiting(self) -> bool:
        return self.wait_share > WAIT_SHARE_HIGH

    @property
    def held(self) -> bool:
        return self.held_share > BACKPRESSURE_SHARE_HIGH or (
            self.held_windows >= BACKPRESSURE_FREQUENT and self.held_share > BACKPRESSURE_FREQUENT_SHARE
        )


def diagnose_bottleneck(history: History) -> Finding:
    steady = _steady(history)
    step_s = _mean(steady.series("perf/step_s")[1])
    rollout_waits = steady.series("perf/rollout_wait_s")[1]
    if not rollout_waits or not step_s > 0:
        return Finding(
            "bottleneck",
            "unknown",
            "perf/step_s and perf/rollout_wait_s were not logged.",
            "Log every step.",
        )
    # backpressure_s is only logged by windows in which generation waited: the others count as 0.
    backpressure = [record.get("rollout/backpressure_s") or 0.0 for record in steady.records]
    held_windows = sum(1 for value in backpressure if value > 0) / len(backpressure)
    waits = _Waits(step_s, _mean(rollout_waits), _mean(backpressure), held_windows)
    return _bottleneck_reading(steady, waits, _bottleneck_evidence(steady, waits))


def _bottleneck_evidence(steady: History, waits: _Waits) -> list[str]:
    """The waits on each side, the queue and the staleness, as the finding quotes them."""
    span = _step_range(steady.steps)
    queue = _mean(steady.series("rollout/queue_size")[1])
    samples_per_step = _mean(steady.series("batch/samples_per_step")[1])
    staleness = _mean(steady.series("sample/staleness_mean")[1])
    max_staleness = steady.config.get("max_staleness")
    evidence = [
        (
            f"perf/rollout_wait_s averages {waits.rollout_wait_s:.3g} s, {waits.wait_share:.0%} of "
            f"perf/step_s ({waits.step_s:.3g} s), over {span}"
        ),
        (
            f"rollout/backpressure_s averages {waits.backpressure_s:.3g} s per window "
            f"({waits.held_share:.0%} of a step); generation waited in {waits.held_windows:.0%} of the "
            f"windows of {span}"
        ),
    ]
    if not math.isnan(queue):
        queue_text = f"rollout/queue_size averages {queue:.3g} samples"
        if samples_per_step > 0:
            queue_text += f" ({queue / samples_per_step:.2g} steps of samples)"
        evidence.append(queue_text + f" over {span}")
    if not math.isnan(staleness) and max_staleness is not None:
        evidence.append(f"sample/staleness_mean averages {staleness:.2g} (max_staleness={max_staleness})")
    return evidence


def _bottleneck_reading(steady: History, waits: _Waits, evidence: list[str]) -> Finding:
    """The verdict from whether the trainer waits for samples and whether generation is held back."""
    if waits.waiting and waits.held:
        return Finding(
            "bottleneck",
            "max_staleness too tight",
            "The trainer waits for samples while generation is held back: the rollouts in flight fill the "
            "staleness allowance before their samples reach the queue.",
            "Raise max_staleness.",
            evidence,
        )
    if waits.waiting:
        action = (
            "Look at rollout/generated_tokens_per_s, rollout/concurrency and rollout/score_queue_size: add "
            "or speed up vLLM servers, raise max_concurrent_rollouts if concurrency sits at it with a low "
            "KV-cache usage, or make reward functions faster if groups wait to be scored."
        )
        if _at_concurrency_limit(steady):
            action = (
                "Raise max_concurrent_rollouts if your environments and tools allow it: concurrency sits at "
                "it while vLLM's KV cache is mostly free."
            )
        return Finding(
            "bottleneck",
            "generation-bound",
            "The queue runs dry and the trainer waits for samples.",
            action,
            evidence + _concurrency_evidence(steady),
        )
    if waits.held:
        return Finding(
            "bottleneck",
            "trainer-bound",
            "Generation is held back max_staleness steps ahead of training; samples wait in the queue.",
            "Expected when inference is faster than training. To go faster, speed up the trainer (more or "
            "faster training devices, a larger token_budget) or move resources from inference to training.",
            evidence,
        )
    return Finding(
        "bottleneck",
        "balanced",
        "Neither side waits for long: the trainer rarely finds the queue empty and generation is rarely "
        "held.",
        "Nothing to change.",
        evidence,
    )


def _at_concurrency_limit(history: History) -> bool:
    """Concurrency near max_concurrent_rollouts (within 70%) with the KV cache under half full."""
    concurrency = _mean(history.series("rollout/concurrency")[1])
    kv = _mean(history.series("rollout/vllm_kv_cache_usage_frac")[1])
    limit = history.config.get("max_concurrent_rollouts")
    return bool(limit) and concurrency >= CONCURRENCY_AT_LIMIT * limit and not kv >= KV_BUSY


def _concurrency_evidence(history: History) -> list[str]:
    concurrency = _mean(history.series("rollout/concurrency")[1])
    cap = _mean(history.series("rollout/concurrency_cap")[1])
    kv = _mean(history.series("rollout/vllm_kv_cache_usage_frac")[1])
    limit = history.config.get("max_concurrent_rollouts")
    if math.isnan(concurrency):
        return []
    text = f"rollout/concurrency averages {concurrency:.3g}"
    if not math.isnan(cap):
        text += f" against a cap of {cap:.3g}"
    if limit is not None:
        text += f" (max_concurrent_rollouts={limit})"
    if not math.isnan(kv):
        text += f", KV-cache usage {kv:.0%}"
    return [text]


# -- saturation, regression, collapse ---------------------------------------------------------------


@dataclass(frozen=True)
class _Saturation:
    """The first-to-last-third trends, on the reward range's scale (0: its bottom, 1: its top)."""

    frac_last: float  # frac_zero_std_groups in the last third
    climbing: bool  # more groups without signal than at the start, and many
    reward_change: float
    reward_position: float
    stuck: bool  # reward_zero_std_groups was logged: the fields below say where those groups sit
    position: float = math.nan
    stuck_change: float = math.nan


def diagnose_saturation(history: History, reward_range: tuple[float, float] = (0.0, 1.0)) -> Finding:
    if not history.has("frac_zero_std_groups") or not history.has("reward"):
        return Finding(
            "saturation", "unknown", "frac_zero_std_groups or reward was not logged.", "Log every step."
        )
    return _saturation_reading(history, *_saturation_trends(history, reward_range))


def _saturation_trends(history: History, reward_range: tuple[float, float]) -> tuple[_Saturation, list[str]]:
    """The trends the saturation reading goes by, and the evidence quoting them."""
    low, high = reward_range
    width = high - low
    frac_first, frac_last, first_span, last_span = _thirds(history, "frac_zero_std_groups")
    reward_first, reward_last, _, _ = _thirds(history, "reward")
    evidence = [
        f"frac_zero_std_groups {frac_first:.2f} ({first_span}) -> {frac_last:.2f} ({last_span})",
        f"reward {reward_first:.3g} -> {reward_last:.3g} (reward range assumed [{low:g}, {high:g}])",
    ]
    trends = _Saturation(
        frac_last,
        climbing=frac_last - frac_first >= FRAC_CLIMB and frac_last >= FRAC_LOW,
        reward_change=(reward_last - reward_first) / width,
        reward_position=(reward_last - low) / width,
        stuck=history.has("reward_zero_std_groups"),
    )
    if trends.stuck:
        stuck_first, stuck_last, _, _ = _thirds(history, "reward_zero_std_groups")
        trends = replace(
            trends, position=(stuck_last - low) / width, stuck_change=(stuck_last - stuck_first) / width
        )
        evidence.append(
            f"reward_zero_std_groups {stuck_first:.3g} -> {stuck_last:.3g}: the groups without signal sit "
            f"{trends.position:.0%} of the way up the reward range"
        )
    return trends, evidence


def _saturation_reading(history: History, trend: _Saturation, evidence: list[str]) -> Finding:
    """The verdict: healthy, saturated at the top, stuck at the bottom, a mixture, a regression."""
    if trend.frac_last < FRAC_LOW and not trend.climbing:
        return Finding(
            "saturation",
            "healthy",
            "Most groups have different rewards, so most groups give a gradient.",
            "Nothing to change.",
            evidence,
        )
    if not trend.stuck:
        return Finding(
            "saturation",
            "unknown",
            "Many groups carry no signal, but reward_zero_std_groups was not logged to say where they sit.",
            "Read a few completions.",
            evidence,
        )
    if trend.climbing and trend.stuck_change <= -REWARD_TREND and trend.reward_change <= -REWARD_TREND:
        return Finding(
            "saturation",
            "regression",
            "Groups that used to pass now fail together: more groups without signal, at a lower reward.",
            "Check completions/duplicate_frac and entropy for a collapse; consider an earlier checkpoint.",
            evidence,
        )
    if (
        (trend.climbing or trend.frac_last >= FRAC_HIGH)
        and trend.position >= TOP
        and (trend.reward_change >= REWARD_TREND or trend.reward_position >= TOP)
    ):
        return Finding(
            "saturation",
            "saturated at the top",
            "The prompts have become too easy for the policy: whole groups succeed. This is how a successful "
            "run usually ends.",
            "Stop the run, or move on to harder prompts.",
            evidence,
        )
    if (
        trend.frac_last >= FRAC_HIGH
        and trend.position <= BOTTOM
        and trend.reward_position <= BOTTOM
        and abs(trend.reward_change) < REWARD_TREND
    ):
        return Finding(
            "saturation",
            "stuck at the bottom",
            "The prompts are too hard, or the reward function never credits the completions: whole groups "
            "fail.",
            "Check completions/clipped_ratio first (a completion cut before its answer scores 0), then "
            "read a few completions to check that the reward function can parse them.",
            evidence + _clipped_evidence(history),
        )
    if trend.frac_last >= FRAC_HIGH and BOTTOM < trend.position < TOP:
        return Finding(
            "saturation",
            "mixture",
            "Some prompts are too easy while others are too hard (with partial-credit rewards, groups can "
            "also be stuck at one partial score).",
            "Read the rollouts.",
            evidence,
        )
    return Finding(
        "saturation",
        "unclear",
        "Many groups carry no signal, but the trends match none of the readings.",
        "Read the rollouts and the plots.",
        evidence,
    )


def _clipped_evidence(history: History) -> list[str]:
    steps, values = history.series("completions/clipped_ratio")
    if not values:
        return []
    return [f"completions/clipped_ratio averages {_mean(values):.2f} over {_step_range(steps)}"]


def diagnose_duplicates(history: History) -> Finding:
    if not history.has("completions/duplicate_frac"):
        return Finding(
            "duplicates", "unknown", "completions/duplicate_frac was not logged.", "Log every step."
        )
    generations = history.config.get("num_generations", 8)
    ceiling = (generations - 1) / generations
    first, last, first_span, last_span = _thirds(history, "completions/duplicate_frac")
    evidence = [
        (
            f"completions/duplicate_frac {first:.2f} ({first_span}) -> {last:.2f} ({last_span}); all copies "
            f"of one rollout would be {ceiling:.2f} with num_generations={generations}"
        )
    ]
    entropy_falling = False
    if history.has("entropy"):
        entropy_first, entropy_last, _, _ = _thirds(history, "entropy")
        entropy_falling = entropy_last < (1 - ENTROPY_FALL) * entropy_first
        evidence.append(f"entropy {entropy_first:.3g} -> {entropy_last:.3g}")
    if last >= DUPLICATE_JUMP * ceiling and not (last - first >= DUPLICATE_RISE and entropy_falling):
        return Finding(
            "duplicates",
            "sampling not random",
            "Every group returns copies of one rollout: sampling is not random.",
            "Check the temperature (it must be > 0) and that data-parallel vLLM engines do not share one "
            "sampling seed.",
            evidence,
        )
    if last - first >= DUPLICATE_RISE and entropy_falling:
        return Finding(
            "duplicates",
            "collapse",
            "The policy is converging to a single answer per prompt: duplicates rise while entropy falls.",
            "Stop or go back to an earlier checkpoint; lower the learning rate or raise the temperature.",
            evidence,
        )
    return Finding(
        "duplicates",
        "healthy",
        "The rollouts of a group are sampled independently.",
        "Nothing to change.",
        evidence,
    )


# -- trainer/sampler mismatch ----------------------------------------------------------------------


def diagnose_mismatch(history: History) -> Finding:
    """Does the sampler/trainer disagreement grow? With the split by staleness, says which part."""
    metric = next((name for name in MISMATCH_FLOOR if history.has(name)), None)
    if metric is None:
        return Finding("mismatch", "unknown", "sampling/mismatch_kl/mean was not logged.", "Log every step.")
    first, last, first_span, last_span = _thirds(history, metric)
    evidence = [f"{metric} {first:.3g} ({first_span}) -> {last:.3g} ({last_span})"]
    for part in ("sampling/mismatch_kl/fresh_mean", "sampling/mismatch_kl/stale_mean"):
        if history.has(part):
            part_first, part_last, _, _ = _thirds(history, part)
            evidence.append(f"{part} {part_first:.3g} -> {part_last:.3g}")
    if history.has("sampling/masked_mean"):
        evidence.append(
            f"sampling/masked_mean averages {_mean(history.series('sampling/masked_mean')[1]):.3g}"
        )
    if not (last >= MISMATCH_GROWTH * first and last > MISMATCH_FLOOR[metric]):
        return Finding(
            "mismatch",
            "steady",
            "The sampler and the trainer disagree no more at the end than at the start.",
            "Nothing to change.",
            evidence,
        )
    fresh_grows = False
    if history.has("sampling/mismatch_kl/fresh_mean"):
        fresh_first, fresh_last, _, _ = _thirds(history, "sampling/mismatch_kl/fresh_mean")
        fresh_grows = fresh_last >= MISMATCH_GROWTH * fresh_first and fresh_last > MISMATCH_FLOOR[metric]
    if fresh_grows:
        action = (
            "Samples of the trainer's own policy version disagree more and more: numerics, not staleness. "
            "Check that the server runs the trainer's dtype, and for MoE models the routing; a sequence "
            "mode or off_policy_mask_threshold bounds the damage meanwhile."
        )
    else:
        action = (
            "Compare sample/staleness_mean with the split by staleness: if only old samples disagree more, "
            "lower max_staleness or the learning rate; a sequence mode or off_policy_mask_threshold masks "
            "the worst sequences (watch sampling/masked_sequences/any)."
        )
    return Finding(
        "mismatch",
        "growing",
        "The sampler and the trainer disagree more and more: the correction has more to mask every step, "
        "and long asynchronous runs destabilize this way.",
        action,
        evidence,
    )


# -- held-out reward against training reward ----------------------------------------------------------


def diagnose_held_out(history: History, reward_range: tuple[float, float] = (0.0, 1.0)) -> Finding:
    """Training reward against each eval dataset's `eval_reward`, as trends (first third of the
    evaluations against the last, a change of REWARD_TREND of the range)."""
    low, high = reward_range
    width = high - low
    evidence, falling = [], []
    if history.has("reward"):
        train_first, train_last, first_span, last_span = _thirds(history, "reward")
        train_change = (train_last - train_first) / width
        evidence.append(f"reward {train_first:.3g} ({first_span}) -> {train_last:.3g} ({last_span})")
    else:
        train_change = 0.0
    evaluated = 0
    for prefix in history.eval_prefixes():
        name = f"{prefix}_reward"
        steps, values = history.series(name)
        if len(values) < 2:
            continue
        evaluated += 1
        first, last, first_span, last_span = _thirds(history, name)
        best = max(range(len(values)), key=values.__getitem__)
        evidence.append(
            f"{name} {first:.3g} ({first_span}) -> {last:.3g} ({last_span}); highest {values[best]:.3g} "
            f"at step {steps[best]}"
        )
        if (last - first) / width <= -REWARD_TREND:
            falling.append((name, steps[best]))
    if not evaluated:
        return Finding(
            "held_out",
            "unknown",
            "Fewer than two evaluations were logged: no trend to read.",
            "Evaluate more often (eval_steps).",
            evidence,
        )
    if falling and train_change >= REWARD_TREND:
        name, best_step = falling[0]
        return Finding(
            "held_out",
            "overfitting or reward hacking",
            f"The training reward rises while {name} falls: the policy learns what scores on the training "
            "prompts (or what the reward function can be fooled by), not the task.",
            f"Keep the weights of step {best_step}, where {name} peaked (load_best_model_at_end=True with "
            "metric_for_best_model keeps the best checkpoint); read high-reward training completions for an "
            "exploit of the reward function; train on more, or more varied, prompts.",
            evidence,
        )
    if falling:
        name, best_step = falling[0]
        return Finding(
            "held_out",
            "held-out reward falls",
            f"{name} falls while the training reward does not rise: the run is getting worse.",
            f"Check completions/duplicate_frac and entropy for a collapse; consider the checkpoint of step "
            f"{best_step}.",
            evidence,
        )
    return Finding(
        "held_out",
        "healthy",
        "The held-out reward does not fall.",
        "Nothing to change.",
        evidence,
    )


# -- how a step's time divides ------------------------------------------------------------------------

# The parts of a mean step, as logged (docs/metrics.md); what they leave of perf/step_s is "other":
# planning, packing, metrics, logging, checkpoints, hops between processes.
STEP_PARTS = (
    ("perf/rollout_wait_s", "waiting for samples"),
    ("perf/fwd_bwd_s", "forward/backward"),
    ("perf/optimizer_s", "optimizer"),
    ("perf/weight_sync_s", "weight sync"),
)
OTHER_PART = "other (planning, packing, logging, checkpoints)"
COMPUTE_PARTS = ("forward/backward", "optimizer")


def step_time_division(history: History) -> tuple[float, list[tuple[str, float]]]:
    """The steady windows' mean step and its parts in seconds, largest first (`OTHER_PART` is what the
    logged parts leave; never below 0). Windows without a weight sync count it as 0."""
    steady = _steady(history)
    step_s = _mean(steady.series("perf/step_s")[1])
    parts = []
    for metric, label in STEP_PARTS:
        values = [record.get(metric) or 0.0 for record in steady.records if "perf/step_s" in record]
        parts.append((label, _mean(values)))
    parts.append((OTHER_PART, max(0.0, step_s - sum(seconds for _, seconds in parts))))
    return step_s, sorted(parts, key=lambda part: -part[1])


def diagnose_time(history: History) -> Finding:
    step_s, parts = step_time_division(history)
    if not step_s > 0:
        return Finding("time", "unknown", "perf/step_s was not logged.", "Log every step.")
    span = _step_range(_steady(history).steps)
    division = ", ".join(f"{label} {seconds:.3g} s ({seconds / step_s:.0%})" for label, seconds in parts)
    evidence = [f"perf/step_s averages {step_s:.3g} s over {span}: {division}"]
    steady = _steady(history)
    efficiency = _mean(steady.series("perf/overlap_efficiency")[1])
    if not math.isnan(efficiency):
        fixed = _mean(steady.series("perf/fixed_cost_s")[1])
        evidence.append(
            f"perf/overlap_efficiency averages {efficiency:.2f}; perf/fixed_cost_s {fixed:.3g} s per step"
        )
    largest, seconds = parts[0]
    explanation = f"A step of {step_s:.3g} s divides into {division}."
    if largest in COMPUTE_PARTS:
        return Finding(
            "time",
            "mostly compute",
            explanation,
            "Nothing to cut around the compute; speed up the compute itself (bigger rows, a faster device).",
            evidence,
        )
    actions = {
        "waiting for samples": "The trainer waits for generation or scoring: see the bottleneck finding.",
        "weight sync": "Sync less often (weight_sync_steps) or use the NCCL backend on GPUs; the timeline "
        "shows which part of the sync (prepare, pause, reload) takes the time.",
        OTHER_PART: "Open timeline.json: the trainer's lane shows which phase outside compute takes it "
        "(checkpoints: save less often; logging: log less often).",
    }
    return Finding("time", f"mostly {largest.split(' (')[0]}", explanation, actions[largest], evidence)


def diagnose(history: History, reward_range: tuple[float, float] = (0.0, 1.0)) -> list[Finding]:
    """How the step time divides, the readings of every run, and the held-out one when the run evaluated."""
    findings = [
        diagnose_time(history),
        diagnose_bottleneck(history),
        diagnose_saturation(history, reward_range),
        diagnose_duplicates(history),
        diagnose_mismatch(history),
    ]
    if history.eval_prefixes():
        findings.append(diagnose_held_out(history, reward_range))
    return findings
