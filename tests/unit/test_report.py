"""`asyncgrpo report` on runs recorded with the tiny model and one deliberately bad setting each
(tests/data/report_runs/record.py says how): every plot renders, the diagnosis names the planted
case, and the HTML opens in headless Chromium without console errors, with the plots on screen."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from support_paths import DATA

from asyncgrpo.cli import main
from asyncgrpo.report.diagnosis import diagnose
from asyncgrpo.report.history import load_run
from asyncgrpo.report.plots import CHECKPOINT_PLOT, EVAL_PLOT, PLOTS, TEACHER_PLOT, plots_for

RUNS = DATA / "report_runs"
# case -> (bottleneck, saturation) the report must name. The tiny model on CPU trains slower than
# vLLM generates 8 tokens, so a run with nothing slowed down is trainer-bound.
EXPECTED = {
    "healthy": ("trainer-bound", "healthy"),
    "tight_staleness": ("max_staleness too tight", "healthy"),
    "slow_trainer": ("trainer-bound", "healthy"),
    "low_concurrency": ("generation-bound", "healthy"),
    "saturating": (None, "saturated at the top"),
    "never_varies": (None, "stuck at the bottom"),
    "reward_hacking": (None, None),
}
# case -> the held-out reading, for the runs that evaluated.
HELD_OUT = {"reward_hacking": "overfitting or reward hacking"}


@pytest.fixture
def run_copy(tmp_path):
    def copy(case: str) -> Path:
        return Path(shutil.copytree(RUNS / case, tmp_path / case))

    return copy


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_report_renders_every_plot_and_names_the_planted_case(case, run_copy, capsys):
    run_dir = run_copy(case)
    assert main(["report", str(run_dir)]) == 0
    assert "report.html" in capsys.readouterr().out
    specs = plots_for(load_run(run_dir))
    assert (EVAL_PLOT in specs) == (case in HELD_OUT), "the evaluation plot is drawn for runs that evaluated"
    for spec in specs:
        png = run_dir / "plots" / f"{spec.name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", spec.name
    html = (run_dir / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(specs)
    assert "not logged in this run" not in html, "a recorded run logs every plotted question"
    findings = {finding.question: finding for finding in diagnose(load_run(run_dir))}
    bottleneck, saturation = EXPECTED[case]
    if bottleneck is not None:
        assert findings["bottleneck"].verdict == bottleneck, findings["bottleneck"].evidence
    if saturation is not None:
        assert findings["saturation"].verdict == saturation, findings["saturation"].evidence
    assert ("held_out" in findings) == (case in HELD_OUT)
    if case in HELD_OUT:
        assert findings["held_out"].verdict == HELD_OUT[case], findings["held_out"].evidence
        assert "eval_reward" in html and "step" in findings["held_out"].action
    assert findings["duplicates"].verdict == "healthy"
    if case == "low_concurrency":
        assert findings["bottleneck"].action.startswith("Raise max_concurrent_rollouts")
    for finding in findings.values():
        assert f"<div class='verdict'>{finding.verdict}</div>" in html
        assert finding.evidence and all(line.split()[0] in html for line in finding.evidence)


# The questions the report's plots answer, as the metrics each must show.
PLOTTED = {
    "reward": ["reward", "reward_trained"],
    "zero_std_groups": ["frac_zero_std_groups", "reward_zero_std_groups"],
    "duplicates_entropy": ["completions/duplicate_frac", "entropy"],
    "policy_loss": ["clip_ratio/region_mean", "cispo_clip_ratio", "vespo/phi_seq_mean", "kl"],
    "clipped_ratio": ["completions/clipped_ratio"],
    "staleness": ["sample/staleness_mean", "sample/dropped_stale_count"],
    "mismatch": ["sampling/mismatch_kl/mean", "sampling/mismatch_kl/stale_mean", "sampling/masked_mean"],
    "queue": ["rollout/queue_size", "perf/rollout_wait_s", "rollout/backpressure_s"],
    "concurrency": ["rollout/concurrency", "rollout/concurrency_cap", "rollout/vllm_kv_cache_usage_frac"],
    "throughput": ["perf/wall_clock_trained_tokens_per_s", "perf/wall_clock_mfu"],
    "weight_sync": ["perf/weight_sync_s"],
    "checkpoints": ["perf/checkpoint_stall_s", "perf/checkpoint_write_s"],
    "evaluation": ["reward", "eval_reward", "eval_pass@1"],
    "teacher": ["jsd", "teacher_kl", "eval_teacher_kl", "rollout/teacher_lost_groups"],
}


def test_each_plot_draws_every_metric_it_is_about(tmp_path):
    # The recorded CPU runs cannot log MFU (no peak FLOPs on CPU): a history with every metric checks the
    # rest.
    from asyncgrpo.report.history import History
    from asyncgrpo.report.plots import render_plot

    metrics = {
        curve.metric for spec in PLOTS + (EVAL_PLOT, TEACHER_PLOT, CHECKPOINT_PLOT) for curve in spec.curves
    }
    history = History.from_records(
        [{"step": step, **{name: 0.1 * step for name in metrics}} for step in range(1, 6)],
        {"max_staleness": 2, "max_concurrent_rollouts": 8},
    )
    drawn = {
        spec.name: render_plot(spec, history, tmp_path / f"{spec.name}.png") for spec in plots_for(history)
    }
    assert set(drawn) == set(PLOTTED)
    for name, wanted in PLOTTED.items():
        assert set(wanted) <= set(drawn[name]), name


def test_the_report_names_the_loss_a_run_trained(tmp_path):
    """The settings line says which loss trained (a loss_type, or which of asyncgrpo's own) and the
    loss menu's fields the run changed; a default run's line names none of them."""
    from asyncgrpo.report.history import History
    from asyncgrpo.report.html import _settings

    records = [{"step": 1, "reward": 0.5}]
    default = _settings(History.from_records(records, {"num_generations": 8, "score_centering": True}))
    assert default == "Settings: num_generations=8, loss: score-centered."
    dapo = History.from_records(
        records,
        {
            "loss_type": "dapo",
            "score_centering": False,
            "beta": 0.04,
            "scale_rewards": "batch",
            "delta": None,
        },
    )
    assert _settings(dapo) == "Settings: loss_type=dapo, beta=0.04, scale_rewards=batch."


def test_the_evaluation_plot_draws_each_named_eval_dataset(tmp_path):
    from asyncgrpo.report.history import History
    from asyncgrpo.report.plots import render_plot

    records = [{"step": step, "reward": 0.1 * step} for step in range(1, 6)]
    records += [{"step": step, "eval_math_reward": 0.5, "eval_code_reward": 0.4} for step in (0, 5)]
    history = History.from_records(records)
    drawn = render_plot(EVAL_PLOT, history, tmp_path / "evaluation.png")
    assert drawn == ["reward", "eval_code_reward", "eval_math_reward"]


def test_a_distillation_run_gets_the_teacher_plot_and_no_reward_evaluation(tmp_path):
    """A distillation run logs no reward: its evaluations (`eval_teacher_kl`, per named eval dataset) are
    drawn in the teacher's plot, and the reward evaluation's plot is left out."""
    from asyncgrpo.report.history import History
    from asyncgrpo.report.plots import render_plot

    records = [{"step": step, "jsd": 1.0 / step, "teacher_kl/taught": 0.5} for step in range(1, 6)]
    records += [
        {"step": step, "eval_math_teacher_kl": 2.0 / (step + 1), "eval_teacher_kl/taught": 1.0}
        for step in (0, 5)
    ]
    history = History.from_records(records)
    assert history.eval_prefixes() == [] and history.eval_prefixes("teacher_kl") == ["eval_math"]
    specs = plots_for(history)
    assert TEACHER_PLOT in specs and EVAL_PLOT not in specs
    assert render_plot(TEACHER_PLOT, history, tmp_path / "teacher.png") == ["jsd", "eval_math_teacher_kl"]


def test_report_names_a_missing_run(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        main(["report", str(tmp_path)])


# -- the HTML in a real browser ---------------------------------------------------------------------


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(
        "headless Chromium is needed to check report.html: make test installs it (scripts/ensure_chromium.sh)"
    )


def open_in_chromium(page: Path, screenshot: Path) -> list[str]:
    """Load `page` headless, save a screenshot; returns the console messages Chromium logged."""
    result = subprocess.run(
        [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            f"--screenshot={screenshot}",
            "--window-size=1500,2400",
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert screenshot.exists(), result.stderr[-2000:]
    return [line for line in result.stderr.splitlines() if ":CONSOLE" in line]


def test_the_console_check_sees_a_script_error(tmp_path):
    page = tmp_path / "broken.html"
    page.write_text("<html><body><script>not_defined();</script></body></html>")
    messages = open_in_chromium(page, tmp_path / "broken.png")
    assert any("not_defined" in message for message in messages)


def test_report_opens_in_chromium_without_console_errors_and_shows_the_plots(run_copy, tmp_path):
    run_dir = run_copy("healthy")
    assert main(["report", str(run_dir)]) == 0
    screenshot = tmp_path / "report.png"
    assert open_in_chromium(run_dir / "report.html", screenshot) == []
    from matplotlib import image

    pixels = (image.imread(screenshot)[..., :3] * 255).astype(int)
    # matplotlib's first two line colors (#1f77b4 blue, #ff7f0e orange) only come from the plots.
    for color in ((31, 119, 180), (255, 127, 14)):
        matching = np.all(np.abs(pixels - np.array(color)) <= 8, axis=-1).sum()
        assert matching > 2000, f"plot color {color} covers only {matching} pixels of the screenshot"


# -- the timeline plot and how a step's time divides ------------------------------------------------


def write_synthetic_timeline(path: Path, steps: int = 5) -> None:
    """A timeline of `steps` one-second steps with every kind of event the plot draws, CPU counters
    included (the trainer on core 0, the server on core 1, each fully busy)."""
    from asyncgrpo.run import timeline
    from asyncgrpo.run.cpu_use import counter

    recorder = timeline.TimelineRecorder(path)
    second = 1_000_000
    for step in range(1, steps + 1):
        recorder.begin_step(step)
        start = step * second
        trainer = [
            ("step", 0.0, 1.0),
            ("take samples", 0.0, 0.3),
            ("wait for samples", 0.05, 0.3),
            ("forward", 0.3, 0.45),
            ("backward", 0.45, 0.7),
            ("optimizer", 0.7, 0.75),
            ("weight sync", 0.75, 0.95),
            ("prepare", 0.75, 0.85),
            ("pause", 0.85, 0.86),
            ("reload", 0.86, 0.94),
            ("resume", 0.94, 0.95),
        ]
        for name, begin, end in trainer:
            recorder.add(
                timeline.event(name, start + begin * second, start + end * second, timeline.TRAINER, "main")
            )
        worker = [
            ("rollout", "request 0", 0.0, 0.6),
            ("rollout", "request 1", 0.1, 0.7),
            ("score", "scorer 0", 0.6, 0.65),
            ("backpressure", "generate loop", 0.7, 0.95),
        ]
        for name, lane, begin, end in worker:
            recorder.add(
                timeline.event(name, start + begin * second, start + end * second, timeline.WORKER, lane)
            )
        recorder.add(
            timeline.event(
                "paused", start + 0.85 * second, start + 0.95 * second, timeline.SERVERS, "generation"
            )
        )
        for process, label, core in ((timeline.TRAINER, "trainer", 0), (timeline.SERVERS, "vllm 7", 1)):
            for tick in range(4):
                ts = start + tick * second // 4
                recorder.add_counter(counter("cores busy", ts, process, {label: 1.0}))
                recorder.add_counter(counter(f"core: {label}", ts, process, {"core": core}))
    recorder.write()


def test_report_draws_the_timeline_and_says_how_the_step_divides(run_copy, tmp_path):
    from asyncgrpo.report.timeline_plot import steps_to_draw

    run_dir = run_copy("healthy")
    write_synthetic_timeline(run_dir / "timeline.json")
    assert main(["report", str(run_dir)]) == 0
    png = run_dir / "plots" / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = (run_dir / "report.html").read_text()
    assert "<h2>Timeline</h2>" in html and "steps 3-5 of timeline.json" in html
    assert html.count("data:image/png;base64,") == len(PLOTS) + 1
    assert "How does a step&#x27;s time divide?" in html
    assert "cores: trainer 1.00, vLLM servers 1.00 busy on average over steps 1-5" in html
    screenshot = tmp_path / "report.png"
    assert open_in_chromium(run_dir / "report.html", screenshot) == []
    trace = {"traceEvents": [{"ph": "X", "name": "step", "args": {"step": s}} for s in (1, 2, 3, 7, 8, 20)]}
    assert steps_to_draw(trace) == [1, 2, 3]
    assert steps_to_draw(trace, count=2) == [7, 8]


def test_the_time_finding_names_the_largest_part_of_a_step():
    from asyncgrpo.report.diagnosis import diagnose_time
    from asyncgrpo.report.history import History

    def history(**parts) -> History:
        record = {"perf/step_s": 2.0, **parts}
        return History.from_records([{"step": step, **record} for step in range(1, 6)], {})

    waiting = diagnose_time(
        history(**{"perf/rollout_wait_s": 1.2, "perf/fwd_bwd_s": 0.5, "perf/optimizer_s": 0.1})
    )
    assert waiting.verdict == "mostly waiting for samples"
    # 2.0 - 1.2 - 0.5 - 0.1 = 0.2 s left for the rest.
    assert "other (planning, packing, logging, checkpoints) 0.2 s (10%)" in waiting.explanation
    compute = diagnose_time(history(**{"perf/fwd_bwd_s": 1.5, "perf/optimizer_s": 0.1}))
    assert compute.verdict == "mostly compute"
    syncing = diagnose_time(history(**{"perf/fwd_bwd_s": 0.5, "perf/weight_sync_s": 1.0}))
    assert syncing.verdict == "mostly weight sync"
    other = diagnose_time(history(**{"perf/fwd_bwd_s": 0.5, "perf/overlap_efficiency": 0.25}))
    assert other.verdict == "mostly other" and other.evidence[1].startswith("perf/overlap_efficiency")
