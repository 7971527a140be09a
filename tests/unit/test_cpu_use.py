"""The timeline's CPU counters (asyncgrpo/run/cpu_use.py): reading /proc, the counter events, and the
report's reading of them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from asyncgrpo.report.core_use import core_samples, cores_lines, mean_busy
from asyncgrpo.run import cpu_use, timeline

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux only)")


def fake_stat(pid: int, name: str, ppid: int, utime: int, stime: int, processor: int) -> str:
    """A /proc/<pid>/stat line: fields numbered from 1, `comm` (field 2) in parentheses; every field
    not set here holds its own number, so a field read from the wrong place shows."""
    fields = {4: ppid, 14: utime, 15: stime, 39: processor}
    rest = " ".join(str(fields.get(number, 1000 + number)) for number in range(4, 53))
    return f"{pid} ({name}) S {rest}\n"


def test_a_stat_line_is_read_by_field_number_whatever_the_name_holds():
    stat = cpu_use.parse_stat(fake_stat(4242, "VLLM::Engine) (x", ppid=17, utime=300, stime=45, processor=1))
    # Fields 16 and 17 (ended children's time) hold their numbers: 1016 + 1017.
    assert stat == cpu_use.ProcStat(
        pid=4242, name="VLLM::Engine) (x", parent=17, cpu_ticks=345, core=1, children_ticks=2033
    )


def test_cores_busy_is_cpu_seconds_over_wall_seconds():
    # 50 ticks at 100 ticks a second = 0.5 CPU seconds, over 0.25 s of wall time: two cores busy.
    assert cpu_use.cores_busy(100, 150, 0.25, 100) == 2.0
    assert cpu_use.cores_busy(100, 100, 0.25, 100) == 0.0
    assert cpu_use.cores_busy(100, 150, 0.0, 100) == 0.0


def test_the_listening_socket_of_a_port_is_found_in_the_tcp_table():
    table = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 111\n"
        "   1: 0100007F:1F40 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1000        0 222\n"
        "   2: 0100007F:1F41 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 333\n"
    )
    # 0x1F40 = 8000; the second line is a connection to it (state 01), not the listener.
    assert cpu_use.listening_inodes([table], 8000) == {"111"}
    assert cpu_use.listening_inodes([table], 8002) == set()


def test_a_server_counts_with_its_child_processes():
    stats = [
        cpu_use.ProcStat(10, "vllm", 1, 0, 0),
        cpu_use.ProcStat(11, "engine", 10, 0, 0),
        cpu_use.ProcStat(12, "helper", 11, 0, 0),
        cpu_use.ProcStat(20, "other", 1, 0, 0),
    ]
    assert cpu_use.with_descendants({10}, stats) == [10, 11, 12]


def test_only_urls_of_this_machine_are_looked_up():
    urls = ["http://localhost:8000", "http://127.0.0.1", "https://[::1]", "http://gpu-node-7:8000"]
    assert cpu_use.local_ports(urls) == [8000, 80, 443]


@linux_only
def test_a_listening_process_of_this_machine_is_found_by_its_url():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert os.getpid() in cpu_use.server_pids([f"http://127.0.0.1:{port}"])


def burn_cpu() -> None:
    """Work for the sampler to see: a fixed amount of it, not a time."""
    total = 0
    for number in range(2_000_000):
        total += number * number
    assert total > 0


@linux_only
def test_the_sampler_records_each_process_busy_share_and_core_from_the_second_tick(tmp_path):
    recorder = timeline.TimelineRecorder(tmp_path / "timeline.json")
    own = [(timeline.TRAINER, timeline.TRAINER, os.getpid()), (timeline.WORKER, timeline.WORKER, 2**22 + 1)]
    sampler = cpu_use.CpuSampler(recorder.add_counter, lambda: own, server_urls=[])
    sampler.sample()
    first_tick = sampler._last_us
    assert recorder.current == []  # one reading is no interval yet
    burn_cpu()
    sampler.sample()
    trace = recorder.trace()
    pids = {item["args"]["name"]: item["pid"] for item in trace["traceEvents"] if item["ph"] == "M"}
    counters = [item for item in trace["traceEvents"] if item["ph"] == "C"]
    # The trainer's two counters, timed at the start of the interval they measured; the worker's pid
    # does not exist (pids stay below 2**22), so it has none.
    assert {item["name"] for item in counters} == {"cores busy", "core: trainer"}
    for item in counters:
        assert item["ts"] == first_tick and item["pid"] == pids["trainer"] and item["tid"] == 0
    busy = next(item for item in counters if item["name"] == "cores busy")["args"]["trainer"]
    core = next(item for item in counters if item["name"] == "core: trainer")["args"]["core"]
    assert 0 < busy <= os.cpu_count()
    assert 0 <= core < os.cpu_count()
    assert trace["otherData"]["cpu_cores"] == os.cpu_count()


def test_counters_and_events_have_their_own_caps_and_the_step_frame_is_always_kept(tmp_path):
    recorder = timeline.TimelineRecorder(
        tmp_path / "timeline.json", max_events_per_step=1, max_counters_per_step=2
    )
    recorder.begin_step(1)
    for ts in range(3):
        recorder.add_counter(cpu_use.counter("cores busy", ts, timeline.TRAINER, {"trainer": 1.0}))
    recorder.add(timeline.event("forward", 0, 5, timeline.TRAINER, timeline.MAIN_LANE))
    recorder.add(timeline.event("backward", 5, 9, timeline.TRAINER, timeline.MAIN_LANE))
    recorder.add(timeline.event(timeline.STEP_FRAME, 0, 10, timeline.TRAINER, timeline.MAIN_LANE))
    recorder.begin_step(2)
    recorder.add_counter(cpu_use.counter("cores busy", 5, timeline.TRAINER, {"trainer": 1.0}))
    recorder.write()
    trace = json.loads((tmp_path / "timeline.json").read_text())
    kept = [item["name"] for item in trace["traceEvents"] if item["ph"] != "M"]
    # Two counters and one event fit; the counters leave the event its room; `backward` is over the
    # cap, the step's frame, recorded last, is kept past it; then step 2's counter.
    assert kept == ["cores busy", "cores busy", "forward", "step", "cores busy"]
    assert trace["otherData"]["counters_dropped"] == 1 and trace["otherData"]["events_dropped"] == 1


def synthetic_trace(tmp_path) -> dict:
    """Two one-second steps after a one-second start-up: the trainer busy 1.0 in steps and 0.5 before,
    the server's two processes 0.5 and 0.25 in steps, ticks every half second; 2 cores."""
    recorder = timeline.TimelineRecorder(tmp_path / "timeline.json")
    second = 1_000_000
    recorder.add(timeline.event("open generation session", 0, second, timeline.TRAINER, timeline.MAIN_LANE))
    for tick in range(6):
        ts = tick * second // 2
        in_steps = ts >= second
        recorder.add_counter(
            cpu_use.counter("cores busy", ts, timeline.TRAINER, {"trainer": 1.0 if in_steps else 0.5})
        )
        recorder.add_counter(cpu_use.counter("core: trainer", ts, timeline.TRAINER, {"core": tick % 2}))
        if in_steps:
            series = {"vllm 10": 0.5, "engine 11": 0.25}
            recorder.add_counter(cpu_use.counter("cores busy", ts, timeline.SERVERS, series))
    for step in (1, 2):
        recorder.begin_step(step)
        recorder.add(timeline.event("step", step * second, (step + 1) * second, timeline.TRAINER, "main"))
    recorder.cores = 2
    return recorder.trace()


def test_the_report_averages_each_lane_over_the_steps_and_over_start_up(tmp_path):
    trace = synthetic_trace(tmp_path)
    lanes = core_samples(trace)
    assert list(lanes) == ["trainer", "vLLM servers"]
    assert [tick.core for tick in lanes["trainer"]][:2] == [{"trainer": 0}, {"trainer": 1}]
    # Steps 1-2 hold the ticks at 1.0, 1.5, 2.0 and 2.5 s: the trainer 1.0 at each, the server
    # 0.5 + 0.25 = 0.75 at each; start-up holds the ticks at 0 and 0.5 s: the trainer 0.5, no server.
    assert mean_busy(lanes["vLLM servers"], [(1_000_000, 3_000_000)]) == 0.75
    assert cores_lines(trace) == [
        "cores: trainer 1.00, vLLM servers 0.75 busy on average over steps 1-2 of 2 available "
        "(together 1.75)",
        "cores: trainer 0.50 busy on average over start-up, before step 1 of 2 available (together 0.50)",
    ]


def test_a_timeline_without_counters_has_no_cores_line(tmp_path):
    recorder = timeline.TimelineRecorder(tmp_path / "timeline.json")
    recorder.begin_step(1)
    recorder.add(timeline.event("step", 0, 10, timeline.TRAINER, "main"))
    assert cores_lines(recorder.trace()) == []


ROUNDING = 1e-9
BURN = "total = 0\nfor number in range(3_000_000):\n    total += number * number\n"


def busy_seconds(recorder, sampler) -> float:
    """The trainer's CPU seconds over the sampler's last interval, from its last counter. The counter
    holds a share of the interval, so seconds come back through a division and a product: up to
    ROUNDING below the exact count of clock ticks when this process itself used none."""
    counters = [item for item in recorder.current if item["name"] == "cores busy"]
    last = [item for item in counters if item["process"] == timeline.TRAINER][-1]
    return last["args"]["trainer"] * (sampler._last_us - last["ts"]) / 1e6


@linux_only
def test_an_own_process_counts_with_the_processes_it_starts_once_each(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_use, "DESCENDANT_LOOKUP_INTERVAL_S", 0.0)  # look children up at every tick
    recorder = timeline.TimelineRecorder(tmp_path / "timeline.json")
    # Children this process had before (the suite's vLLM servers, which spin for a second after each
    # request) are tracked apart, so that the trainer's count holds only what the test starts.
    earlier = [
        stat.pid
        for stat in map(cpu_use.read_stat, cpu_use.all_pids())
        if stat is not None and stat.parent == os.getpid()
    ]
    own = [(timeline.TRAINER, timeline.TRAINER, os.getpid())]
    own += [("earlier children", str(pid), pid) for pid in earlier]
    sampler = cpu_use.CpuSampler(recorder.add_counter, lambda: own, server_urls=[])
    sampler.sample()
    # A child that works, says so and waits: found alive at the next tick, all its time counted.
    child = subprocess.Popen(
        [sys.executable, "-c", BURN + "print('done', flush=True)\ninput()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline() == "done\n"
    child_cpu = cpu_use.read_stat(child.pid).cpu_ticks / os.sysconf("SC_CLK_TCK")
    sampler.sample()
    assert busy_seconds(recorder, sampler) >= child_cpu - ROUNDING
    # It ends and is waited for: its time moves to this process's count of ended children, and is
    # not counted a second time.
    child.communicate("\n")
    sampler.sample()
    assert busy_seconds(recorder, sampler) < child_cpu / 2
    # A child that starts and ends between two ticks counts through that same count.
    before = os.times()
    sampler.sample()
    subprocess.run([sys.executable, "-c", BURN], check=True)
    sampler.sample()
    ended_cpu = (
        os.times().children_user + os.times().children_system - before.children_user - before.children_system
    )
    assert busy_seconds(recorder, sampler) >= ended_cpu * 0.9


def test_a_ticks_figures_are_scaled_down_together_to_the_machines_cores():
    # 1.5 + 0.5 + 0.5 = 2.5 cores measured on 2: every figure times 2 / 2.5 = 0.8.
    measured = {"trainer": {"trainer": 1.5}, "vLLM servers": {"EngineCore 7": 0.5, "Worker 8": 0.5}}
    scaled = cpu_use.within_the_machine(measured, cores=2)
    assert scaled["trainer"] == {"trainer": pytest.approx(1.2)}
    assert scaled["vLLM servers"] == {"EngineCore 7": pytest.approx(0.4), "Worker 8": pytest.approx(0.4)}
    assert cpu_use.within_the_machine({"trainer": {"trainer": 2.0}}, cores=2) == {"trainer": {"trainer": 2.0}}
