"""Progress output: a bar over steps (or prompts, when epochs decide the end) and one short line per
log, instead of the base Trainer's dump of ~60 metrics (those still reach `report_to` and
`state.log_history`)."""

from __future__ import annotations

import math

from tqdm.auto import tqdm
from transformers import TrainerCallback

SUMMARY_KEYS = (
    ("reward", "reward"),
    ("reward_trained", "trained"),
    ("loss", "loss"),
    ("entropy", "entropy"),
    ("frac_zero_std_groups", "zero_std"),
    ("perf/step_s", "step_s"),
    ("perf/rollout_wait_s", "wait_s"),
    ("sample/staleness_mean", "stale"),
)


class AsyncProgressCallback(TrainerCallback):
    def __init__(self, total: int, unit: str):
        self.total = total
        self.unit = unit
        self.bar: tqdm | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and not args.disable_tqdm:
            self.bar = tqdm(total=self.total, unit=self.unit, dynamic_ncols=True, desc="async GRPO")

    def advance_to(self, value: int) -> None:
        if self.bar is not None:
            self.bar.update(max(0, min(value, self.total) - self.bar.n))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        parts = [f"step {state.global_step}"]
        for key, label in SUMMARY_KEYS:
            value = logs.get(key)
            if isinstance(value, (int, float)) and not math.isnan(value):
                parts.append(f"{label}={value:.4g}")
        line = "  ".join(parts)
        if self.bar is not None:
            self.bar.write(line)
        elif not args.disable_tqdm:
            print(line, flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
