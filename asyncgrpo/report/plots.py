"""The report's plots: one PNG per question a reader asks of a run, drawn with matplotlib.

A metric a run did not log is left out of its plot; a plot with nothing to draw says so in the image,
so the report always has the same set of plots in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from asyncgrpo.report.history import History


@dataclass(frozen=True)
class Curve:
    metric: str
    right_axis: bool = False  # a second y-axis, for a metric of another unit


@dataclass(frozen=True)
class PlotSpec:
    name: str  # the PNG's file name, without .png
    title: str
    curves: tuple[Curve, ...]
    left_label: str = ""
    right_label: str = ""
    limit_of: str | None = None  # a config field drawn as a horizontal line (on the left axis)


PLOTS = (
    PlotSpec(
        "reward",
        "Reward: all scored groups vs. trained samples",
        (Curve("reward"), Curve("reward_trained")),
        "reward",
    ),
    PlotSpec(
        "zero_std_groups",
        "Groups without signal and where they are stuck",
        (Curve("frac_zero_std_groups"), Curve("reward_zero_std_groups", True)),
        "fraction of groups",
        "reward of those groups",
    ),
    PlotSpec(
        "duplicates_entropy",
        "Duplicate rollouts and entropy",
        (Curve("completions/duplicate_frac"), Curve("entropy", True)),
        "duplicate fraction",
        "entropy (nats)",
    ),
    PlotSpec(
        "policy_loss",
        "The loss: trust region, capped weights and the KL to the reference",
        (
            Curve("clip_ratio/region_mean"),
            Curve("cispo_clip_ratio"),
            Curve("vespo/phi_seq_mean"),
            Curve("kl", True),
        ),
        "fraction clipped (VESPO: mean weight)",
        "KL to the reference (nats)",
    ),
    PlotSpec(
        "clipped_ratio",
        "Completions cut at max_completion_length",
        (Curve("completions/clipped_ratio"),),
        "fraction",
    ),
    PlotSpec(
        "staleness",
        "Staleness and dropped samples",
        (
            Curve("sample/staleness_mean"),
            Curve("sample/staleness_max"),
            Curve("sample/dropped_stale_count", True),
        ),
        "steps behind",
        "samples dropped per window",
        limit_of="max_staleness",
    ),
    PlotSpec(
        "mismatch",
        "Sampler/trainer mismatch and what the correction masks",
        (
            Curve("sampling/mismatch_kl/mean"),
            Curve("sampling/mismatch_kl/fresh_mean"),
            Curve("sampling/mismatch_kl/stale_mean"),
            Curve("sampling/masked_mean", True),
            Curve("sampling/masked_sequences/any", True),
            Curve("sampling/truncated_tokens/high", True),
        ),
        "KL (k3, nats)",
        "fraction masked or truncated",
    ),
    PlotSpec(
        "queue",
        "Queue size against waits on either side",
        (
            Curve("rollout/queue_size"),
            Curve("perf/rollout_wait_s", True),
            Curve("rollout/backpressure_s", True),
        ),
        "samples",
        "seconds",
    ),
    PlotSpec(
        "concurrency",
        "Concurrent rollouts, their cap and vLLM's KV cache",
        (
            Curve("rollout/concurrency"),
            Curve("rollout/concurrency_cap"),
            Curve("rollout/vllm_kv_cache_usage_frac", True),
        ),
        "rollouts",
        "KV-cache usage",
        limit_of="max_concurrent_rollouts",
    ),
    PlotSpec(
        "throughput",
        "Throughput and model FLOPs utilization",
        (
            Curve("perf/wall_clock_trained_tokens_per_s"),
            Curve("rollout/generated_tokens_per_s"),
            Curve("perf/wall_clock_mfu", True),
        ),
        "tokens/s",
        "MFU",
    ),
    PlotSpec(
        "weight_sync",
        "Weight sync time",
        (
            Curve("perf/weight_sync_s"),
            Curve("perf/weight_sync_pause_s"),
            Curve("perf/weight_sync_transfer_s"),
        ),
        "seconds",
    ),
)


# Drawn when the run evaluated (eval_dataset): one curve per eval dataset of each `eval_` metric.
EVAL_PLOT = PlotSpec(
    "evaluation",
    "Held-out reward beside the training reward",
    (Curve("reward"), Curve("eval_reward"), Curve("eval_pass@1", True)),
    "reward",
    "pass@1",
)


# Drawn when the run had a teacher (distillation, or GRPO's teacher term): how far the student is from it.
TEACHER_PLOT = PlotSpec(
    "teacher",
    "Distance to the teacher: the trained divergence, the sampled tokens' KL, held out",
    (Curve("jsd"), Curve("teacher_kl"), Curve("eval_teacher_kl"), Curve("rollout/teacher_lost_groups", True)),
    "nats per token",
    "groups lost with their teacher",
)


# Drawn when the run wrote checkpoints.
CHECKPOINT_PLOT = PlotSpec(
    "checkpoints",
    "Checkpoint saves: the step held, against the whole write",
    (Curve("perf/checkpoint_stall_s"), Curve("perf/checkpoint_write_s")),
    "seconds",
)


def plots_for(history: History) -> tuple[PlotSpec, ...]:
    """The report's plots for this run: PLOTS, the evaluation's when it evaluated a reward, the
    teacher's when it had one, the checkpoints' when it wrote any."""
    plots = PLOTS + (EVAL_PLOT,) if history.eval_prefixes() else PLOTS
    if history.has("jsd") or history.has("teacher_kl"):
        plots += (TEACHER_PLOT,)
    saved = any("perf/checkpoint_stall_s" in record for record in history.records)
    return plots + (CHECKPOINT_PLOT,) if saved else plots


def _curves(spec: PlotSpec, history: History) -> list[Curve]:
    """The spec's curves, an `eval_` curve repeated for each eval dataset the run logged."""
    curves = []
    for curve in spec.curves:
        if curve.metric.startswith("eval_"):
            figure = curve.metric.removeprefix("eval_")
            prefixes = history.eval_prefixes(figure)
            curves += [Curve(f"{prefix}_{figure}", curve.right_axis) for prefix in prefixes]
        else:
            curves.append(curve)
    return curves


def render_plot(spec: PlotSpec, history: History, path: Path) -> list[str]:
    """Draw `spec` into `path`; returns the metrics it found."""
    try:
        import matplotlib
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "the report draws its plots with matplotlib: pip install 'asyncgrpo[report]'"
        ) from error

    matplotlib.use("Agg")  # files only: no display needed
    from matplotlib import pyplot

    figure, left = pyplot.subplots(figsize=(7, 3.6), dpi=100)
    right = None
    drawn, lines = [], []
    colors = iter(pyplot.rcParams["axes.prop_cycle"].by_key()["color"])
    for curve in _curves(spec, history):
        color = next(colors)
        steps, values = history.series(curve.metric)
        if not steps:
            continue
        if curve.right_axis and right is None:
            right = left.twinx()
        axis = right if curve.right_axis else left
        style = "--" if curve.right_axis else "-"
        lines += axis.plot(
            steps, values, style, color=color, marker="." if len(steps) < 60 else None, label=curve.metric
        )
        drawn.append(curve.metric)
    limit = history.config.get(spec.limit_of) if spec.limit_of else None
    if drawn and isinstance(limit, (int, float)):
        lines.append(left.axhline(limit, color="gray", linestyle=":", label=f"{spec.limit_of}={limit}"))
    if not drawn:
        left.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=left.transAxes)
    left.set_title(spec.title, fontsize=10)
    left.set_xlabel("step")
    left.set_ylabel(spec.left_label)
    if right is not None:
        right.set_ylabel(spec.right_label)
    if lines:
        left.legend(lines, [line.get_label() for line in lines], fontsize=7, loc="best")
    left.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)
    return drawn
