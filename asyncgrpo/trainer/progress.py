"""Live progress: on a terminal, a rich bar with the run's vital signs (reward, tokens/s, queue,
staleness, which side is waiting, ETA) and one short line per log above it; elsewhere (CI, a file),
the same line printed plainly. This replaces the base Trainer's dump of ~60 metrics per log (those
still reach `report_to`, `state.log_history` and the run directory's metrics.jsonl)."""

from __future__ import annotations

import math
import time

from transformers import TrainerCallback

SUMMARY_KEYS = (
    ("reward", "reward"),
    ("reward_trained", "trained"),
    ("loss", "loss"),
    ("entropy", "entropy"),
    ("frac_zero_std_groups", "zero_std"),
    ("perf/wall_clock_trained_tokens_per_s", "tok/s"),
    ("rollout/queue_size", "queue"),
    ("sample/staleness_mean", "stale"),
    ("perf/step_s", "step_s"),
)
# A side "waits" when its wait is more than this share of the step (as in the report's diagnosis).
WAIT_SHARE = 0.2


def waiting_side(logs: dict) -> str:
    """Who waited in this window: the trainer for samples, generation for the trainer, both, or neither."""
    step_s = logs.get("perf/step_s") or 0.0
    if not step_s > 0:
        return "-"
    trainer = (logs.get("perf/rollout_wait_s") or 0.0) / step_s > WAIT_SHARE
    generation = (logs.get("rollout/backpressure_s") or 0.0) / step_s > WAIT_SHARE
    if trainer and generation:
        return "both (max_staleness tight?)"
    if trainer:
        return "trainer waits for rollouts"
    if generation:
        return "generation waits for trainer"
    return "neither"


def summary_line(step: int, logs: dict) -> str:
    parts = [f"step {step}"]
    for key, label in SUMMARY_KEYS:
        value = logs.get(key)
        if isinstance(value, (int, float)) and not math.isnan(value):
            parts.append(f"{label}={value:.4g}")
    parts.append(f"waiting: {waiting_side(logs)}")
    return "  ".join(parts)


def _eta(done: int, total: int, elapsed: float) -> str:
    if done <= 0 or done >= total:
        return "-"
    seconds = int(elapsed / done * (total - done))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class AsyncProgressCallback(TrainerCallback):
    def __init__(self, total: int, unit: str, console=None):
        self.total = total
        self.unit = unit
        self._console = console
        self._progress = None
        self._task = None
        self._done = 0
        self._start_done = 0
        self._started = time.monotonic()

    @classmethod
    def for_run(cls, args, train_dataset) -> AsyncProgressCallback:
        """Counting steps with max_steps, else the prompts of `num_train_epochs` passes."""
        if args.max_steps > 0:
            return cls(total=args.max_steps, unit="step")
        return cls(total=math.ceil(args.num_train_epochs * len(train_dataset)), unit="prompt")

    def on_train_begin(self, args, state, control, **kwargs):
        self._started, self._start_done = time.monotonic(), self._done
        if not state.is_world_process_zero or args.disable_tqdm:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        console = self._console or Console()
        if not console.is_terminal:
            self._console = console
            return
        self._progress = Progress(
            TextColumn("async GRPO"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(self.unit + "s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=console,
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=self.total, completed=self._done, status="")

    def advance_to(self, value: int) -> None:
        self._done = max(0, min(value, self.total))
        if self._progress is not None:
            self._progress.update(self._task, completed=self._done)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or args.disable_tqdm or "train_runtime" in logs:
            return
        line = summary_line(state.global_step, logs)
        if self._progress is not None:
            self._progress.console.print(line, highlight=False)
            status = [f"waiting: {waiting_side(logs)}"]
            if isinstance(logs.get("reward"), (int, float)):
                status.insert(0, f"reward {logs['reward']:.3g}")
            self._progress.update(self._task, status="  ".join(status))
        else:
            eta = _eta(
                self._done - self._start_done, self.total - self._start_done, time.monotonic() - self._started
            )
            print(f"{line}  [{self._done}/{self.total} {self.unit}s, ETA {eta}]", flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
