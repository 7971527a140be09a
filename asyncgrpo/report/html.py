"""`asyncgrpo report RUN_DIR`: PNG plots and a self-contained report.html (plots embedded, no scripts,
no network) with the automatic diagnosis on top."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.report.core_use import cores_lines
from asyncgrpo.report.diagnosis import Finding, diagnose
from asyncgrpo.report.history import History, load_run
from asyncgrpo.report.plots import plots_for, render_plot
from asyncgrpo.report.timeline_plot import load_timeline, render_timeline

REPORT_FILE = "report.html"
PLOTS_DIR = "plots"
TIMELINE_PLOT = "timeline.png"
QUESTIONS = {
    "time": "How does a step's time divide?",
    "bottleneck": "Which side is the bottleneck?",
    "saturation": "Do the groups still carry signal?",
    "duplicates": "Are the rollouts of a group still different?",
    "mismatch": "Do the sampler and the trainer disagree more and more?",
    "held_out": "Does the policy improve on prompts it never trains on?",
}
_STYLE = """
body { font-family: sans-serif; margin: 2em auto; max-width: 1500px; color: #222; }
.finding { border-left: 6px solid #888; padding: 0.4em 1em; margin: 1em 0; background: #f7f7f7; }
.finding.ok { border-color: #2a8; } .finding.warn { border-color: #d80; }
.verdict { font-weight: bold; font-size: 1.1em; }
.plots { display: flex; flex-wrap: wrap; gap: 8px; } .plots figure { margin: 0; }
.plots img { width: 700px; } figcaption { font-size: 0.8em; color: #666; }
img.timeline { width: 1400px; }
"""
_OK_VERDICTS = ("healthy", "balanced", "mostly compute")


def write_report(run_dir: str | Path, reward_range: tuple[float, float] = (0.0, 1.0)) -> Path:
    """Render every plot under RUN_DIR/plots/ and RUN_DIR/report.html; returns the HTML's path."""
    run_dir = Path(run_dir)
    history = load_run(run_dir)
    if not history.records:
        raise ConfigurationError(f"{run_dir} has no logged steps yet: nothing to report")
    plot_dir = run_dir / PLOTS_DIR
    plot_dir.mkdir(exist_ok=True)
    figures = []
    for spec in plots_for(history):
        path = plot_dir / f"{spec.name}.png"
        drawn = render_plot(spec, history, path)
        figures.append((spec, path, drawn))
    trace = load_timeline(run_dir)
    timeline = _timeline_figure(trace, plot_dir)
    findings = diagnose(history, reward_range)
    if trace is not None:  # which process kept the cores busy: evidence for how a step divides
        next(finding for finding in findings if finding.question == "time").evidence += cores_lines(trace)
    report = run_dir / REPORT_FILE
    report.write_text(_html(run_dir, history, findings, figures, timeline), encoding="utf-8")
    return report


def _timeline_figure(trace: dict | None, plot_dir: Path) -> tuple[Path, list[int]] | None:
    """The timeline plot of a few steps, or None for a run without a timeline (or one step short of
    a whole step)."""
    if trace is None:
        return None
    path = plot_dir / TIMELINE_PLOT
    steps = render_timeline(trace, path)
    return (path, steps) if steps else None


def _html(run_dir: Path, history: History, findings: list[Finding], figures, timeline) -> str:
    escape = html.escape
    steps = history.steps
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>asyncgrpo report: {escape(run_dir.name)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>Run {escape(str(run_dir))}</h1>",
        f"<p>{len(steps)} logging windows, steps {steps[0]} to {steps[-1]}. {_settings(history)}</p>",
        "<h2>Diagnosis</h2>",
    ]
    for finding in findings:
        kind = "ok" if finding.verdict in _OK_VERDICTS else "warn"
        parts.append(
            f"<div class='finding {kind}' "
            f"id='{finding.question}'><div>{escape(QUESTIONS[finding.question])}</div><div "
            f"class='verdict'>{escape(finding.verdict)}</div><p>{escape(finding.explanation)}</p><p><b>What "
            f"to do:</b> {escape(finding.action)}</p><ul>"
            + "".join(f"<li>{escape(line)}</li>" for line in finding.evidence)
            + "</ul></div>"
        )
    parts.append("<h2>Plots</h2><div class='plots'>")
    for spec, path, drawn in figures:
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        caption = ", ".join(drawn) if drawn else "not logged in this run"
        parts.append(
            f"<figure><img alt='{escape(spec.title)}' src='data:image/png;base64,{data}'>"
            f"<figcaption>{escape(caption)} ({escape(PLOTS_DIR)}/{escape(path.name)})</figcaption></figure>"
        )
    parts.append("</div>")
    if timeline is not None:
        path, steps = timeline
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        parts.append(
            f"<h2>Timeline</h2><figure><img class='timeline' alt='timeline of steps {steps[0]}-{steps[-1]}' "
            f"src='data:image/png;base64,{data}'><figcaption>steps {steps[0]}-{steps[-1]} of timeline.json "
            f"({escape(PLOTS_DIR)}/{escape(path.name)}); open the whole file in Perfetto "
            "(ui.perfetto.dev) or chrome://tracing</figcaption></figure>"
        )
    parts.append("</body></html>")
    return "\n".join(parts)


def _settings(history: History) -> str:
    names = (
        "num_generations",
        "max_staleness",
        "max_concurrent_rollouts",
        "learning_rate",
        "max_completion_length",
    )
    shown = [f"{name}={history.config[name]}" for name in names if name in history.config]
    shown += _algorithm(history.config)
    return html.escape("Settings: " + ", ".join(shown) + ".") if shown else ""


# The loss menu's fields the report names when a run set them (docs/algorithm.md), with the value
# that means "not used": the loss a run trained is part of what its curves mean.
ALGORITHM_FIELDS = {
    "importance_sampling_level": "token",
    "delta": None,
    "beta": 0.0,
    "sync_ref_model": False,
    "top_entropy_quantile": 1.0,
    "entropy_coef": 0.0,
    "use_adaptive_entropy": False,
    "scale_rewards": "group",
    "multi_objective_aggregation": "sum_then_normalize",
    "reward_weights": None,
    "mask_truncated_completions": False,
}


def _algorithm(config: dict) -> list[str]:
    """The loss the run trained (its loss_type, or which of asyncgrpo's own), and the menu's settings
    it changed."""
    if not config:
        return []
    if config.get("loss_type"):
        shown = [f"loss_type={config['loss_type']}"]
    elif "score_centering" in config:
        shown = ["loss: score-centered" if config["score_centering"] else "loss: clipped surrogate"]
    else:
        shown = []
    shown += [
        f"{name}={config[name]}"
        for name, unused in ALGORITHM_FIELDS.items()
        if name in config and config[name] != unused
    ]
    return shown
