"""`log_completions`: a table of recent completions with their rewards at each logging step, printed
and sent to the trackers of `report_to` that show tables (W&B, trackio), as TRL's GRPO trainer does."""

from __future__ import annotations

import importlib
import logging

from asyncgrpo.records.sample import Sample

logger = logging.getLogger(__name__)

# The `report_to` integrations with a table type, logged as TRL logs its completions: under
# "completions", a `Table` built from a DataFrame.
TABLE_TRACKERS = ("wandb", "trackio")
COMPLETIONS_KEY = "completions"


def completion_rows(samples: list[Sample], tokenizer, step: int) -> list[dict]:
    """One row per sample: the step, its prompt and completion as text, its reward and advantage."""
    rows = []
    for sample in samples:
        first_trained = int(sample.trained.argmax())
        rows.append(
            {
                "step": step,
                "prompt": tokenizer.decode(sample.token_ids[:first_trained], skip_special_tokens=True),
                "completion": tokenizer.decode(sample.token_ids[first_trained:], skip_special_tokens=True),
                "reward": float(sample.reward),
                "advantage": float(sample.advantage),
            }
        )
    return rows


def print_completions(rows: list[dict], step: int) -> None:
    from rich.console import Console  # rich: only when asked for
    from rich.table import Table

    table = Table(title=f"completions at step {step}", show_lines=True)
    table.add_column("prompt", overflow="fold", max_width=50)
    table.add_column("completion", overflow="fold", max_width=70)
    table.add_column("reward", justify="right")
    table.add_column("advantage", justify="right")
    for row in rows:
        table.add_row(
            row["prompt"][-200:], row["completion"][:400], f"{row['reward']:.3f}", f"{row['advantage']:+.3f}"
        )
    Console().print(table)


def log_to_trackers(rows: list[dict], report_to: list[str]) -> list[str]:
    """The rows as a table to each tracker of `report_to` that has tables and a run (the integration's
    callback starts it when training begins); returns the trackers that got it. A tracker that fails
    is warned about: a table must never stop a run."""
    reached = []
    for name in TABLE_TRACKERS:
        if name not in report_to:
            continue
        tracker = importlib.import_module(name)
        if getattr(tracker, "run", True) is None:  # wandb without a run: nothing to log into
            continue
        try:
            from datasets import Dataset  # its DataFrame: both trackers build their tables from one

            frame = Dataset.from_list(rows).to_pandas()
            tracker.log({COMPLETIONS_KEY: tracker.Table(dataframe=frame)})
        except Exception as error:  # a tracker's own failure: report it, keep training
            logger.warning("log_completions: the table did not reach %s: %s", name, error)
            continue
        reached.append(name)
    return reached
