"""How well a window's steps overlapped generation and training (docs/metrics.md, "Overlap").

A step of an asynchronous run ideally lasts as long as the slower of its two sides: the servers
generating its samples, or the trainer computing on them. What it lasts beyond that is fixed cost
that no overlap hides: waiting on a queue the other side filled too late, packing, weight syncs,
logging, process hops.
"""

from __future__ import annotations

import math


def generation_busy_s(step_s: float, generation_idle_frac: float) -> float:
    """Seconds of a step during which the servers generated: the step less its idle share."""
    return step_s * (1.0 - min(max(generation_idle_frac, 0.0), 1.0))


def overlap_figures(
    step_s: float, train_compute_s: float, generation_idle_frac: float
) -> tuple[float, float]:
    """(fixed cost in seconds, overlap efficiency) of a mean step: `train_compute_s` is its forward,
    backward and optimizer time, `generation_idle_frac` the share of time the servers had nothing to
    generate or were paused. Ideal step = max(generation busy, training compute); fixed cost = step -
    ideal (never below 0: timings of two processes do not add up exactly); efficiency = ideal / step."""
    if not step_s > 0 or math.isnan(generation_idle_frac):
        return math.nan, math.nan
    ideal = min(step_s, max(generation_busy_s(step_s, generation_idle_frac), train_compute_s))
    return step_s - ideal, ideal / step_s
