"""The run's timeline and the overlap figures on real runs against the shared vLLM server (tiny
model): a deliberately slow trainer and a deliberately slow reward each show on their own side."""

from __future__ import annotations

import json
import os
import time

import pytest

pytest.importorskip(
    "datasets", reason="datasets is not installed (a GPU host may lack the non-torch dependencies)"
)

from conftest import make_config  # noqa: E402
from test_trainer_e2e import prompts, restore_server, token_parity_reward  # noqa: E402
from timeline_checks import assert_nested, names_by_process  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from worker_side import slow_reward  # noqa: E402 (what the rollout worker imports: tests/support/worker_side.py says why)

from asyncgrpo import AsyncGRPOTrainer  # noqa: E402
from asyncgrpo.report.core_use import core_samples  # noqa: E402
from asyncgrpo.run import cpu_use  # noqa: E402

pytestmark = pytest.mark.vllm

# Seconds added to each reward call (worker_side.SLOW_REWARD_S), or to each optimizer step: many times
# what the tiny model takes to generate a group or to train a step on CPU, so that side dominates
# whatever the machine's load.
# The trainer's is longer: on a loaded machine (the suite's two workers and a busy process beside them)
# generating a step's groups took longer than the reward's figure, and the servers never idled
# (bench/RESULTS.md, "make_test").
SLOW_TRAINER_S = 4.0
STEPS = 3


class SlowTrainer(TrainerCallback):
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        time.sleep(SLOW_TRAINER_S)


# A share of a step a side idles for that the other side's slowness explains: with a slow trainer the
# trainer waits only for the first samples (the first step's wait, which grows with the machine's load:
# over a quarter of a 3-step run on a loaded machine) and hardly at all once samples are queued ahead;
# with a slow reward it waits for scoring at every step but the one its start-up backlog feeds (about
# half of the run).
IDLE_SHARE = 0.3
# With a slow trainer the step is mostly the trainer's compute (its sleep included).
BUSY_SHARE = 0.5


def logged_windows(trainer) -> list[dict[str, float]]:
    """The run's logging windows, in order (one per `logging_steps` steps)."""
    return [entry for entry in trainer.state.log_history if "perf/step_s" in entry]


def run_window(trainer) -> dict[str, float]:
    """The run's one logging window (logging_steps = STEPS): every figure over the whole run."""
    windows = logged_windows(trainer)
    assert len(windows) == 1
    return windows[0]


def run(server, model_dir, output_dir, reward, callbacks=(), **overrides) -> AsyncGRPOTrainer:
    args = make_config(server, output_dir, **(dict(max_steps=STEPS, logging_steps=STEPS) | overrides))
    trainer = AsyncGRPOTrainer(
        str(model_dir), reward, args, train_dataset=prompts(), callbacks=list(callbacks)
    )
    try:
        trainer.train()
    finally:
        restore_server(server.url, model_dir)
    return trainer


def test_slow_trainer_shows_generation_idle_and_the_timeline_holds_every_phase(
    vllm_server, tiny_model_dir, tmp_path
):
    trainer = run(
        vllm_server,
        tiny_model_dir,
        tmp_path,
        token_parity_reward,
        [SlowTrainer()],
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
    )
    windows = logged_windows(trainer)
    assert len(windows) == STEPS
    # Past the first step (the pipeline's fill) the trainer hardly waits; the servers idle more than it
    # does (how much more moves with the machine's load: generation slows on a busy machine, 0.45-0.83
    # seen); the step is mostly compute.
    for window in windows[1:]:
        assert window["perf/trainer_idle_frac"] < IDLE_SHARE, windows
        assert window["perf/generation_idle_frac"] > window["perf/trainer_idle_frac"], windows
        assert window["perf/overlap_efficiency"] > BUSY_SHARE, windows
    for window in windows:
        assert window["perf/sync_pause_s"] > 0
        assert window["perf/fixed_cost_s"] == pytest.approx(
            window["perf/step_s"] * (1 - window["perf/overlap_efficiency"])
        )

    trace = json.loads((tmp_path / "timeline.json").read_text())
    assert_nested(trace)
    names = names_by_process(trace)
    trainer_phases = {"step", "take samples", "pack", "forward", "backward", "optimizer", "weight sync"}
    sync_parts = {"barrier", "prepare", "pause", "reload", "resume"}
    assert trainer_phases | sync_parts | {"log", "checkpoint"} <= names["trainer"]
    assert {"rollout", "score", "backpressure"} <= names["rollout worker"]
    # The servers' lanes: each sync's pause, and each server's time in the run (docs/timeline.md).
    assert "paused" in names["vLLM servers"] and names["vLLM servers"] <= {"paused", "serving", "lost"}
    assert trace["otherData"]["steps_kept"] == list(range(STEPS + 1))
    assert "wait for rollout worker" in names["trainer"]
    assert "wait for the starting weights" in names["rollout worker"]
    # CPU counters for every process of the run: the trainer, the worker, the local server (found by
    # its URL), each with the cores it kept busy and the core it ran on.
    lanes = core_samples(trace)
    assert set(lanes) == {"trainer", "rollout worker", "vLLM servers"}
    for name, ticks in lanes.items():
        assert ticks and all(0 <= sum(tick.busy.values()) <= os.cpu_count() for tick in ticks), name
        assert all(0 <= core < os.cpu_count() for tick in ticks for core in tick.core.values()), name
    assert any(tick.busy["trainer"] > 0 for tick in lanes["trainer"])
    # The server's processes are those this test session started (other servers may run on the
    # machine), the engine core among them; short-lived helpers of the server may have ended since.
    stats = {stat.pid: stat for stat in map(cpu_use.read_stat, cpu_use.all_pids()) if stat}
    started = set(cpu_use.with_descendants({vllm_server.process.pid}, stats.values()))
    labels = {label for tick in lanes["vLLM servers"] for label in tick.busy}
    assert {int(label.rsplit(" ", 1)[1]) for label in labels} & set(stats) <= started, labels
    assert any(label.startswith("VLLM::EngineCor") for label in labels), labels


def test_slow_reward_shows_the_trainer_waiting(vllm_server, tiny_model_dir, tmp_path):
    # One reward thread scores one group at a time, as slowly as the reward runs; max_staleness=0
    # keeps generation from queueing more than a step ahead while the first step compiles.
    trainer = run(
        vllm_server, tiny_model_dir, tmp_path, slow_reward, max_concurrent_rollouts=1, max_staleness=0
    )
    assert run_window(trainer)["perf/trainer_idle_frac"] > IDLE_SHARE
    names = names_by_process(json.loads((tmp_path / "timeline.json").read_text()))
    assert {"wait for samples", "score"} <= names["trainer"] | names["rollout worker"]
