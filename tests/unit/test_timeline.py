"""The timeline recorder, the step selection that bounds it, the worker's idle clock, the overlap
figures and the weight check the timeline showed to be a sync's largest part, without a server
(tests/integration/test_timeline_e2e.py runs them against one)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from timeline_checks import assert_nested, complete_events, names_by_process

from asyncgrpo.records.metrics import MetricsWindow, Reduce, Stat
from asyncgrpo.rollout.idle_clock import IdleClock
from asyncgrpo.run import timeline
from asyncgrpo.trainer.nonfinite import weights_are_finite
from asyncgrpo.trainer.overlap import overlap_figures
from asyncgrpo.trainer.step_metrics import record_window_overlap


@pytest.fixture
def recorder(tmp_path):
    recorder = timeline.TimelineRecorder(
        tmp_path / "timeline.json", first_steps=2, every_kth_step=5, last_steps=3
    )
    timeline.activate(recorder)
    yield recorder
    timeline.activate(None)


def test_spans_nest_on_their_lane_and_the_file_is_a_chrome_trace(recorder):
    recorder.begin_step(1)
    with timeline.span("step"):
        with timeline.span("take samples"):
            with timeline.span("wait for samples"):
                pass
        with timeline.span("weight sync"):
            for part in ("prepare", "pause", "reload", "resume"):
                with timeline.span(part):
                    pass
    worker = [timeline.event("rollout", 10, 20, timeline.WORKER, "request 0", group=3)]
    recorder.add_worker_events(worker, dropped=2)
    timeline.interval("paused", 5, 9, lane="generation", process=timeline.SERVERS)
    recorder.write()
    trace = json.loads(recorder.path.read_text())
    assert_nested(trace)
    names = names_by_process(trace)
    assert names["trainer"] == {"step", "take samples", "wait for samples", "weight sync"} | {
        "prepare",
        "pause",
        "reload",
        "resume",
    }
    assert names["rollout worker"] == {"rollout"} and names["vLLM servers"] == {"paused"}
    events = {item["name"]: item for item in complete_events(trace)}
    step, wait = events["step"], events["wait for samples"]
    assert step["ts"] <= wait["ts"] and wait["ts"] + wait["dur"] <= step["ts"] + step["dur"]
    assert events["rollout"]["args"] == {"group": 3, "step": 1}
    threads = {
        (item["pid"], item["tid"]): item["args"]["name"] for item in trace["traceEvents"] if item["ph"] == "M"
    }
    assert threads[(events["rollout"]["pid"], events["rollout"]["tid"])] == "request 0"
    assert trace["otherData"]["events_dropped"] == 2
    assert not list(recorder.path.parent.glob(".*partial")), "the staging file is renamed, not left"


def test_the_nesting_check_catches_overlapping_spans_on_one_lane():
    trace = {
        "traceEvents": [
            {"name": "a", "ph": "X", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
            {"name": "b", "ph": "X", "ts": 5, "dur": 10, "pid": 1, "tid": 1},
        ]
    }
    with pytest.raises(AssertionError, match="overlaps"):
        assert_nested(trace)


def test_without_a_recorder_spans_record_nothing(tmp_path):
    timeline.activate(None)
    with timeline.span("step"):
        timeline.interval("paused", 0, 1)
    assert timeline.active() is None


def test_the_kept_steps_are_the_first_every_kth_and_the_last(recorder):
    for step in range(1, 23):
        recorder.begin_step(step)
        with timeline.span("step"):
            pass
    # Start-up (0), the first two, every fifth, the newest two others (19, 21) and the running step:
    # the last three steps are all there.
    assert recorder.trace()["otherData"]["steps_kept"] == [0, 1, 2, 5, 10, 15, 19, 20, 21, 22]


def test_a_long_run_keeps_a_bounded_file(tmp_path):
    """Steps of many events each: the file holds at most the kept steps' capped events."""
    recorder = timeline.TimelineRecorder(
        tmp_path / "timeline.json", first_steps=2, every_kth_step=100, last_steps=2, max_events_per_step=50
    )
    timeline.activate(recorder)
    try:
        for step in range(1, 1001):
            recorder.begin_step(step)
            for _ in range(80):
                timeline.interval("rollout", 0, 1, lane="request 0")
    finally:
        timeline.activate(None)
    trace = recorder.trace()
    kept = trace["otherData"]["steps_kept"]
    assert kept == [0, 1, 2, 100, 200, 300, 400, 500, 600, 700, 800, 900, 999, 1000]
    assert len(complete_events(trace)) == 50 * (len(kept) - 1)  # step 0 recorded nothing
    assert trace["otherData"]["events_dropped"] == 30 * 1000


def test_the_worker_buffer_caps_what_waits_between_flushes():
    buffer = timeline.EventBuffer(limit=3)
    for index in range(5):
        buffer.add(timeline.event("score", index, index + 1, timeline.WORKER, "scorer 0"))
    events, dropped = buffer.take()
    assert [item["ts"] for item in events] == [0, 1, 2] and dropped == 2
    assert buffer.take() == ([], 0)


def test_lanes_reuse_the_lowest_free_lane():
    lanes = timeline.Lanes("request")
    first, second, third = lanes.take(), lanes.take(), lanes.take()
    assert (first, second, third) == ("request 0", "request 1", "request 2")
    lanes.give_back(second)
    lanes.give_back(first)
    assert lanes.take() == "request 0"
    assert lanes.take() == "request 1"
    assert lanes.take() == "request 3"


def test_idle_clock_counts_time_with_nothing_running():
    clock = IdleClock(now=0.0)
    clock.started(2.0)  # idle 0-2
    clock.started(3.0)
    clock.finished(5.0)
    clock.finished(6.0)  # idle from 6
    assert clock.take(now=10.0) == (6.0, 10.0)  # 2 + (10 - 6)
    clock.started(11.0)  # idle 10-11
    assert clock.take(now=15.0) == (1.0, 5.0)  # still running at 15
    clock.finished(16.0)
    assert clock.take(now=20.0) == (4.0, 5.0)


def test_overlap_figures_by_hand():
    # A 10 s step, servers idle 40% (busy 6 s), training computes 4 s: ideal 6 s, fixed 4 s.
    assert overlap_figures(10.0, 4.0, 0.4) == pytest.approx((4.0, 0.6))
    # Training is the longer side: ideal 8 s.
    assert overlap_figures(10.0, 8.0, 0.9) == pytest.approx((2.0, 0.8))
    # Timings of two processes that add up to more than the step: no negative fixed cost.
    assert overlap_figures(10.0, 11.0, 0.0) == pytest.approx((0.0, 1.0))
    assert all(math.isnan(value) for value in overlap_figures(10.0, 4.0, math.nan))


def test_a_window_records_its_overlap_from_what_both_processes_recorded():
    window = MetricsWindow()
    for step_s, wait_s in ((4.0, 1.0), (6.0, 3.0)):
        window.record("perf/step_s", step_s)
        window.add("perf/trainer_idle_frac", Stat(Reduce.RATE, wait_s, step_s))
        window.record("perf/fwd_bwd_s", 1.5)
        window.record("perf/optimizer_s", 0.5)
    window.add("perf/generation_idle_frac", Stat(Reduce.RATE, 4.0, 10.0))  # the worker's flushes
    window.add("perf/generation_idle_frac", Stat(Reduce.RATE, 1.0, 0.0))  # a sync froze requests 1 s
    record_window_overlap(window)
    logs = window.summarize()
    # Mean step 5 s; servers idle 5/10, so busy 2.5 s; training 2 s: ideal 2.5 s.
    assert logs["perf/trainer_idle_frac"] == pytest.approx(0.4)
    assert logs["perf/generation_idle_frac"] == pytest.approx(0.5)
    assert logs["perf/fixed_cost_s"] == pytest.approx(2.5)
    assert logs["perf/overlap_efficiency"] == pytest.approx(0.5)


def test_a_window_without_the_workers_share_records_no_overlap():
    window = MetricsWindow()
    window.record("perf/step_s", 4.0)
    window.record("perf/fwd_bwd_s", 1.0)
    record_window_overlap(window)
    assert "perf/overlap_efficiency" not in window.summarize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_weight_check_finds_an_inf_or_a_nan_in_any_parameter(dtype):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(dtype)
    with torch.no_grad():
        model[0].weight.fill_(60000.0 if dtype is torch.float16 else 1e6)  # large, finite: no overflow
    assert weights_are_finite(model)
    for value in (math.inf, -math.inf, math.nan):
        with torch.no_grad():
            model[1].bias[1] = value
        assert not weights_are_finite(model), value
    assert weights_are_finite(torch.nn.Module())  # no parameters


def test_each_rollout_worker_has_its_own_process_lane_and_plot_rows(recorder, tmp_path):
    from asyncgrpo.report.timeline_plot import _rows

    assert timeline.worker_process(0, 1) == timeline.WORKER
    recorder.begin_step(1)
    start = timeline.now_us()
    timeline.interval("step", start, start + 100)
    for worker in [timeline.worker_process(index, 2) for index in (1, 0)]:
        item = timeline.event("rollout", start + 10, start + 20, worker, "request 0")
        recorder.add_worker_events([item], dropped=0)
    timeline.interval("paused", start + 5, start + 9, lane="generation", process=timeline.SERVERS)
    recorder.begin_step(2)
    trace = recorder.trace()
    processes = {
        item["args"]["name"]: item["pid"] for item in trace["traceEvents"] if item["name"] == "process_name"
    }
    assert processes == {"trainer": 1, "rollout worker 0": 2, "rollout worker 1": 3, "vLLM servers": 4}
    request_pids = sorted(item["pid"] for item in complete_events(trace) if item["name"] == "rollout")
    assert request_pids == [2, 3]
    labels = [label for label, events in _rows(trace, [1])[0] if events]
    assert "rollout worker 0: request 0" in labels and "rollout worker 1: request 0" in labels
