"""The automatic diagnosis on synthetic histories: each reading of the metrics, and its evidence."""

from __future__ import annotations

import json

import pytest

from asyncgrpo.report.diagnosis import (
    diagnose,
    diagnose_bottleneck,
    diagnose_duplicates,
    diagnose_held_out,
    diagnose_mismatch,
    diagnose_saturation,
)
from asyncgrpo.report.history import History, load_run

STEPS = 30


def history(config=None, **series) -> History:
    """series: metric -> a function of the step (1..STEPS) or a constant."""
    records = []
    for step in range(1, STEPS + 1):
        record = {"step": step}
        for name, value in series.items():
            record[name.replace("__", "/")] = value(step) if callable(value) else value
        records.append(record)
    return History.from_records(records, config or {"max_staleness": 4, "num_generations": 8})


def ramp(start, end):
    return lambda step: start + (end - start) * (step - 1) / (STEPS - 1)


# -- bottleneck: rollout_wait_s against backpressure_s, per step time ------------------------------


def timing(wait, backpressure, queue):
    return history(
        perf__step_s=2.0,
        perf__rollout_wait_s=wait,
        rollout__backpressure_s=backpressure,
        rollout__queue_size=queue,
        batch__samples_per_step=32,
        sample__staleness_mean=1.0,
    )


@pytest.mark.parametrize(
    ("wait", "backpressure", "queue", "verdict"),
    [
        (1.5, 0.0, 0, "generation-bound"),
        (0.0, 1.5, 128, "trainer-bound"),
        (1.2, 1.2, 2, "max_staleness too tight"),
        (1.2, 0.3, 2, "max_staleness too tight"),  # short waits, but in every window
        (0.1, 0.05, 20, "balanced"),
    ],
)
def test_bottleneck_readings(wait, backpressure, queue, verdict):
    finding = diagnose_bottleneck(timing(wait, backpressure, queue))
    assert finding.verdict == verdict
    assert any("perf/rollout_wait_s" in line and "75%" in line for line in finding.evidence) == (wait == 1.5)


def test_bottleneck_ignores_the_start_up_wait_and_counts_windows_without_backpressure_as_zero():
    # The first step waits 10 s for the first rollouts; afterwards nothing waits. Backpressure is only
    # logged (high) in one window of 30: on average generation is not held.
    finding = diagnose_bottleneck(
        history(
            perf__step_s=2.0,
            perf__rollout_wait_s=lambda step: 10.0 if step == 1 else 0.0,
            rollout__backpressure_s=lambda step: 3.0 if step == 20 else None,
        )
    )
    assert finding.verdict == "balanced"


def test_bottleneck_without_timing_metrics_is_unknown():
    assert diagnose_bottleneck(history(reward=0.5)).verdict == "unknown"


# -- saturation: frac_zero_std_groups, reward_zero_std_groups and reward --------------------------


@pytest.mark.parametrize(
    ("frac", "stuck", "reward", "verdict"),
    [
        (0.05, 0.5, ramp(0.3, 0.6), "healthy"),
        (ramp(0.1, 0.8), ramp(0.85, 0.97), ramp(0.5, 0.9), "saturated at the top"),
        (0.9, 0.0, 0.03, "stuck at the bottom"),
        (ramp(0.1, 0.7), ramp(0.9, 0.3), ramp(0.7, 0.4), "regression"),
        (0.8, 0.5, 0.5, "mixture"),
    ],
)
def test_saturation_readings(frac, stuck, reward, verdict):
    finding = diagnose_saturation(
        history(frac_zero_std_groups=frac, reward_zero_std_groups=stuck, reward=reward)
    )
    assert finding.verdict == verdict
    assert finding.evidence[0].startswith("frac_zero_std_groups")
    assert "steps 1-10" in finding.evidence[0] and "steps 21-30" in finding.evidence[0]


def test_saturation_reads_positions_in_the_given_reward_range():
    # Rewards in [0, 10]: groups stuck at 0.5 are at the bottom, not in the middle.
    series = dict(frac_zero_std_groups=0.9, reward_zero_std_groups=0.5, reward=0.6)
    assert diagnose_saturation(history(**series), reward_range=(0, 10)).verdict == "stuck at the bottom"
    assert diagnose_saturation(history(**series), reward_range=(0, 1)).verdict == "mixture"


def test_stuck_at_the_bottom_points_at_clipped_completions():
    finding = diagnose_saturation(
        history(
            frac_zero_std_groups=0.95, reward_zero_std_groups=0.0, reward=0.01, completions__clipped_ratio=0.9
        )
    )
    assert finding.verdict == "stuck at the bottom"
    assert "clipped_ratio" in finding.action
    assert any("completions/clipped_ratio averages 0.90" in line for line in finding.evidence)


# -- duplicates --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("duplicates", "entropy", "verdict"),
    [
        (0.02, 1.5, "healthy"),
        (lambda step: 0.02 if step < 15 else 0.87, 1.5, "sampling not random"),
        (ramp(0.05, 0.5), ramp(2.0, 0.5), "collapse"),
        (ramp(0.05, 0.5), 2.0, "healthy"),  # more duplicates at a steady entropy: not a collapse
    ],
)
def test_duplicate_readings(duplicates, entropy, verdict):
    finding = diagnose_duplicates(history(completions__duplicate_frac=duplicates, entropy=entropy))
    assert finding.verdict == verdict


def test_duplicates_ceiling_follows_num_generations():
    # 0.45 is copies-of-one for groups of 2, but not for groups of 8.
    series = dict(completions__duplicate_frac=0.45, entropy=1.0)
    assert diagnose_duplicates(history({"num_generations": 2}, **series)).verdict == "sampling not random"
    assert diagnose_duplicates(history({"num_generations": 8}, **series)).verdict == "healthy"


# -- reading the run directory -------------------------------------------------------------------------


def test_load_run_keeps_the_last_record_of_a_step_and_tolerates_a_cut_last_line(tmp_path):
    lines = [
        {"step": 1, "reward": 0.1},
        {"step": 2, "reward": 0.2},
        {"step": 2, "reward": 0.25},  # resumed: step 2 logged again
        {"step": 3, "reward": None},  # NaN written as null
        {"step": 3, "train_runtime": 12.0, "train_loss": 0.1},  # the end-of-training summary
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines) + '{"step": 4, "rew'
    (tmp_path / "metrics.jsonl").write_text(text)
    (tmp_path / "config.json").write_text(json.dumps({"max_staleness": 2}))
    run = load_run(tmp_path)
    assert run.series("reward") == ([1, 2], [0.1, 0.25])
    assert run.steps == [1, 2, 3]
    assert run.config["max_staleness"] == 2


def test_load_run_names_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2 is not JSON"):
        load_run(tmp_path)


def test_generation_bound_at_max_concurrent_rollouts_says_to_raise_it():
    series = dict(perf__step_s=2.0, perf__rollout_wait_s=1.5, rollout__concurrency=60.0)
    at_limit = diagnose_bottleneck(
        history({"max_concurrent_rollouts": 64}, rollout__vllm_kv_cache_usage_frac=0.1, **series)
    )
    assert at_limit.action.startswith("Raise max_concurrent_rollouts")
    kv_full = diagnose_bottleneck(
        history({"max_concurrent_rollouts": 64}, rollout__vllm_kv_cache_usage_frac=0.9, **series)
    )
    below = diagnose_bottleneck(
        history({"max_concurrent_rollouts": 512}, rollout__vllm_kv_cache_usage_frac=0.1, **series)
    )
    assert kv_full.verdict == below.verdict == "generation-bound"
    assert not kv_full.action.startswith("Raise") and not below.action.startswith("Raise")


# -- mismatch: sampling/mismatch_kl, split by staleness ---------------------------------------------


@pytest.mark.parametrize(
    ("fresh", "stale", "verdict", "numerics"),
    [
        (1e-3, ramp(1e-3, 0.05), "growing", False),  # only old samples disagree more: staleness
        (ramp(1e-3, 0.05), ramp(1e-3, 0.05), "growing", True),  # the numerics drift
        (2e-4, 3e-4, "steady", False),
        (ramp(1e-5, 5e-4), ramp(1e-5, 5e-4), "steady", False),  # grows, but below the bf16 floor
    ],
)
def test_mismatch_readings(fresh, stale, verdict, numerics):
    def mean(step):
        return ((fresh(step) if callable(fresh) else fresh) + (stale(step) if callable(stale) else stale)) / 2

    finding = diagnose_mismatch(
        history(
            sampling__mismatch_kl__mean=mean,
            sampling__mismatch_kl__fresh_mean=fresh,
            sampling__mismatch_kl__stale_mean=stale,
            sampling__masked_mean=0.01,
        )
    )
    assert finding.verdict == verdict
    assert finding.evidence[0].startswith("sampling/mismatch_kl/mean")
    assert finding.action.startswith("Samples of the trainer's own policy version") == numerics


def test_mismatch_falls_back_to_the_log_prob_difference_and_else_is_unknown():
    finding = diagnose_mismatch(history(sampling__sampling_logp_difference__mean=ramp(0.01, 0.5)))
    assert finding.verdict == "growing"
    assert diagnose_mismatch(history(reward=0.5)).verdict == "unknown"


# -- held-out reward against training reward --------------------------------------------------------------


def evaluated(train, evals: dict[str, object], every: int = 5) -> History:
    """A run logging `reward` = train(step) every step and, in lines of their own (as the trainer logs
    them), each eval metric = value(step) at step 0 and every `every` steps."""
    records = [{"step": step, "reward": train(step)} for step in range(1, STEPS + 1)]
    for step in range(0, STEPS + 1, every):
        records.append({"step": step, **{name: value(step) for name, value in evals.items()}})
    return History.from_records(records, {"num_generations": 8})


def test_training_reward_rising_while_eval_reward_falls_is_flagged_with_the_best_step():
    run = evaluated(ramp(0.2, 0.8), {"eval_reward": lambda step: 0.6 if step == 10 else 0.5 - step / 100})
    finding = diagnose_held_out(run)
    assert finding.verdict == "overfitting or reward hacking"
    assert "step 10" in finding.action and "load_best_model_at_end" in finding.action
    # Means of the first and last thirds of the seven evaluations (two each), and the peak.
    assert "eval_reward 0.475 (steps 0-5) -> 0.225 (steps 25-30); highest 0.6 at step 10" in finding.evidence
    # The evaluation's lines were merged into the windows of their steps; step 0 has an evaluation alone.
    assert run.series("eval_reward")[0] == [0, 5, 10, 15, 20, 25, 30]
    assert run.records[5]["reward"] == ramp(0.2, 0.8)(5) and "eval_reward" in run.records[5]


@pytest.mark.parametrize(
    ("train", "held_out", "verdict"),
    [
        (ramp(0.2, 0.8), ramp(0.3, 0.7), "healthy"),
        (ramp(0.5, 0.5), ramp(0.6, 0.2), "held-out reward falls"),
        (ramp(0.2, 0.8), ramp(0.5, 0.49), "healthy"),  # a change under 5% of the range is no trend
    ],
)
def test_held_out_readings(train, held_out, verdict):
    assert diagnose_held_out(evaluated(train, {"eval_reward": held_out})).verdict == verdict


def test_each_named_eval_dataset_is_read_and_one_evaluation_is_no_trend():
    run = evaluated(ramp(0.2, 0.8), {"eval_math_reward": ramp(0.3, 0.8), "eval_code_reward": ramp(0.8, 0.2)})
    assert run.eval_prefixes() == ["eval_code", "eval_math"]
    finding = diagnose_held_out(run)
    assert finding.verdict == "overfitting or reward hacking" and "eval_code_reward" in finding.explanation
    once = evaluated(ramp(0.2, 0.8), {"eval_reward": ramp(0.5, 0.5)}, every=STEPS + 1)
    assert diagnose_held_out(once).verdict == "unknown"


def test_the_held_out_question_is_asked_only_of_runs_that_evaluated():
    plain = history(reward=0.5)
    assert [finding.question for finding in diagnose(plain)] == [
        "time",
        "bottleneck",
        "saturation",
        "duplicates",
        "mismatch",
    ]
    run = evaluated(ramp(0.2, 0.8), {"eval_reward": ramp(0.3, 0.7)})
    assert diagnose(run)[-1].question == "held_out"
