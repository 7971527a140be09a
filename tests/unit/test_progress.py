"""Live progress: the vital signs line, who is waiting, a rich bar on a terminal and plain lines elsewhere."""

from __future__ import annotations

import io
from types import SimpleNamespace

from rich.console import Console

from asyncgrpo.trainer.progress import AsyncProgressCallback, summary_line, waiting_side

LOGS = {
    "reward": 0.5,
    "perf/wall_clock_trained_tokens_per_s": 1234.0,
    "rollout/queue_size": 52.0,
    "sample/staleness_mean": 3.5,
    "perf/step_s": 2.0,
    "perf/rollout_wait_s": 0.0,
    "rollout/backpressure_s": 1.0,
}


def test_waiting_side_compares_each_wait_with_the_step():
    assert waiting_side({"perf/step_s": 2.0, "perf/rollout_wait_s": 1.0}) == "trainer waits for rollouts"
    assert waiting_side({"perf/step_s": 2.0, "rollout/backpressure_s": 1.0}) == "generation waits for trainer"
    assert waiting_side(
        {"perf/step_s": 2.0, "perf/rollout_wait_s": 1.0, "rollout/backpressure_s": 1.0}
    ).startswith("both")
    assert waiting_side({"perf/step_s": 2.0, "perf/rollout_wait_s": 0.1}) == "neither"
    assert waiting_side({}) == "-"


def test_summary_line_has_the_vital_signs():
    line = summary_line(7, LOGS)
    for part in (
        "step 7",
        "reward=0.5",
        "tok/s=1234",
        "queue=52",
        "stale=3.5",
        "waiting: generation waits for trainer",
    ):
        assert part in line


def _run(console: Console, capsys) -> str:
    args = SimpleNamespace(disable_tqdm=False)
    state = SimpleNamespace(is_world_process_zero=True, global_step=0)
    progress = AsyncProgressCallback(total=10, unit="step", console=console)
    progress.on_train_begin(args, state, None)
    for step in (1, 2):
        state.global_step = step
        progress.advance_to(step)
        progress.on_log(args, state, None, logs=LOGS)
    progress.on_train_end(args, state, None)
    return console.file.getvalue() + capsys.readouterr().out


def test_plain_lines_when_not_a_terminal(capsys):
    output = _run(Console(file=io.StringIO(), force_terminal=False), capsys)
    lines = [line for line in output.splitlines() if line]
    assert len(lines) == 2 and lines[1].startswith("step 2") and "[2/10 steps, ETA" in lines[1]


def test_rich_bar_on_a_terminal(capsys):
    output = _run(Console(file=io.StringIO(), force_terminal=True, width=200), capsys)
    assert "step 2" in output and "async GRPO" in output and "2/10" in output and "ETA" in output
    assert "reward 0.5" in output  # the bar's status field


def test_the_demo_figures_count_optimizer_steps_even_when_the_last_logged_no_reward(capsys):
    """A step whose metrics window held no rollout's reward yet logs none: the figures line still
    counts it (the saturation e2e test saw steps=2 printed for a run of 3)."""
    from asyncgrpo.cli.demo import report_figures

    history = [
        {"step": 0, "eval_pass@1": 0.1},
        {"step": 1, "reward": 0.42},
        {"step": 2, "reward": 0.52},
        {"step": 3, "loss": 0.1},
        {"step": 3, "eval_pass@1": 0.2},
    ]
    report_figures(history, minutes=1.0, seed=0)
    assert "steps=3 minutes=1.0 seed=0" in capsys.readouterr().out
