"""Unit tests of the reliability rules (no server): reward deadlines and finiteness, server flag checks,
the samples a checkpoint carries, reading a TRL checkpoint, bounded waits, the server guard."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

from asyncgrpo.generation.background import BackgroundLoop  # noqa: E402
from asyncgrpo.generation.client import auth_headers, parse_policy_label, policy_label  # noqa: E402
from asyncgrpo.generation.server_info import check_logprobs_mode, parse_server_info  # noqa: E402
from asyncgrpo.records.sample import Sample  # noqa: E402
from asyncgrpo.rollout.activity import ActivityBoard  # noqa: E402
from asyncgrpo.rollout.concurrency import RolloutSlots  # noqa: E402
from asyncgrpo.rollout.reward_errors import RewardCallFailure, RewardErrorBudget  # noqa: E402
from asyncgrpo.rollout.scoring import RewardFunctionError, call_reward_functions  # noqa: E402
from asyncgrpo.trainer.held_samples import load_held_samples, save_held_samples  # noqa: E402
from asyncgrpo.trainer.prompt_ledger import PromptLedger, RolloutState  # noqa: E402


def call(functions, timeout_s=math.inf, catch_errors=False):
    executor = ThreadPoolExecutor(2)
    try:
        return asyncio.run(
            call_reward_functions(
                functions,
                executor,
                [[]] * 2,
                [[]] * 2,
                [[1], [2]],
                {},
                timeout_s,
                " (dataset row 7)",
                catch_errors,
            )
        )
    finally:
        executor.shutdown(wait=False)  # a stuck call's thread is abandoned, as the worker does


# Far longer than the 0.3 s deadline, so "returned at the deadline" and "waited for the function" are
# seconds apart, whatever the load on the machine.
def slow(completions, **kwargs):
    time.sleep(10)
    return [0.0, 1.0]


async def async_slow(completions, **kwargs):
    await asyncio.sleep(10)
    return [0.0, 1.0]


@pytest.mark.parametrize("function", [slow, async_slow])
def test_a_reward_call_past_its_deadline_names_the_function_and_the_row(function):
    started = time.monotonic()
    with pytest.raises(
        RewardFunctionError,
        match=rf"'{function.__name__}' did not return within reward_timeout=0.3 s \(dataset row 7\)",
    ):
        call([function], timeout_s=0.3)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, np.float32("inf")])
def test_non_finite_rewards_are_errors_naming_the_function_and_the_value(value):
    def judge(completions, **kwargs):
        return [1.0, value]

    with pytest.raises(RewardFunctionError, match=r"reward function 'judge' returned (inf|-inf|nan)"):
        call([judge])


def judge_503(completions, **kwargs):
    raise ConnectionError("503 from the judge at 12:00:01 (request 7f3a)")


async def async_judge_503(completions, **kwargs):
    raise ConnectionError("503 from the judge at 12:00:02 (request 9b1c)")


def fine(completions, **kwargs):
    return [0.0, 1.0]


@pytest.mark.parametrize("function", [judge_503, async_judge_503])
def test_a_raising_reward_comes_back_as_a_failure_when_caught_and_raises_otherwise(function):
    failure, rewards = call([function, fine], catch_errors=True)
    assert isinstance(failure, RewardCallFailure) and rewards == [0.0, 1.0]
    assert (
        failure.function == function.__name__ and "ConnectionError: 503 from the judge" in failure.traceback
    )
    with pytest.raises(ConnectionError, match="503"):  # reward_error_tolerance=0: TRL's behaviour
        call([function, fine])
    with pytest.raises(RewardFunctionError, match="did not return within"):  # a deadline is never caught
        call([slow], timeout_s=0.3, catch_errors=True)


def test_the_error_budget_drops_groups_logs_each_error_once_and_stops_a_broken_function(caplog):
    budget = RewardErrorBudget(tolerance=0.5, window=4)
    assert budget.catches and not RewardErrorBudget(0.0, 4).catches
    failures = [call([judge_503], catch_errors=True)[0], call([async_judge_503], catch_errors=True)[0]]
    failures[1].function = "judge_503"  # the same error, another time and request id
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.rollout.reward_errors"):
        assert budget.group_failed([failures[0]], " (dataset row 1)")
        assert not budget.group_failed([[1.0, 0.0]], " (dataset row 2)")
        assert budget.group_failed([failures[1]], " (dataset row 3)")
    assert caplog.text.count("reward function 'judge_503' raised") == 1, "one log per distinct error"
    # 2 of 3 failed: not more than 0.5 of the window (4) yet.
    with pytest.raises(RewardFunctionError) as stopped:
        budget.group_failed([failures[0]], " (dataset row 4)")  # 3 of the last 4
    assert "'judge_503' raised on 3 of the last 4 groups scored (dataset row 4)" in str(stopped.value)
    assert "ConnectionError: 503 from the judge" in str(stopped.value), "its last traceback"


def test_the_reward_error_settings_are_checked():
    from asyncgrpo import AsyncGRPOConfig

    for bad in (
        dict(reward_error_tolerance=1.0),
        dict(reward_error_tolerance=-0.1),
        dict(reward_error_window=0),
    ):
        with pytest.raises(ValueError, match="reward_error_"):
            AsyncGRPOConfig(output_dir="unused", **bad)


def test_none_stays_not_scored():
    def partial(completions, **kwargs):
        return [None, 2]

    assert call([partial]) == [[None, 2.0]]


def test_server_flags_are_checked():
    info = parse_server_info(
        {
            "vllm_config": {
                "model_config": {"logprobs_mode": "raw_logprobs", "dtype": "torch.bfloat16"},
                "lora_config": None,
            }
        }
    )
    assert info.dtype == "bfloat16" and not info.lora_enabled
    with pytest.raises(ValueError, match="--logprobs-mode processed_logprobs"):
        check_logprobs_mode(info, "http://x:8000")
    check_logprobs_mode(
        parse_server_info({"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs"}}}), "u"
    )
    check_logprobs_mode(None, "u")  # a server without /server_info cannot be checked


def test_policy_labels_tell_the_trainers_weights_from_a_restarted_servers():
    assert parse_policy_label(policy_label(12)) == 12
    assert parse_policy_label("default") is None and parse_policy_label(None) is None
    assert parse_policy_label("asyncgrpo-policy-x") is None


def test_the_api_key_is_sent_when_set(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert auth_headers() == {}
    monkeypatch.setenv("VLLM_API_KEY", "k")
    assert auth_headers() == {"Authorization": "Bearer k"}


def sample(stream_index: int, with_top: bool, with_sets: bool, with_routing: bool = False) -> Sample:
    rng = np.random.default_rng(stream_index)
    trained = np.array([False, False, True, True, True])
    return Sample(
        token_ids=rng.integers(0, 100, 5),
        trained=trained,
        sampler_logprobs=rng.normal(size=3).astype(np.float32),
        advantage=0.5,
        group_id=3,
        top_ids=rng.integers(0, 100, (3, 4)) if with_top else None,
        top_logprobs=rng.normal(size=(3, 4)).astype(np.float32) if with_top else None,
        candidate_sets=[np.array([1, 2]), np.array([], dtype=np.int64), np.array([5])] if with_sets else None,
        routed_experts=rng.integers(0, 8, (4, 2, 2)).astype(np.uint8) if with_routing else None,
        model_version=4,
        row_index=9,
        stream_index=stream_index,
        epoch=1,
        reward=1.0,
        rollout_id=f"r{stream_index}",
        queued_at=123.5,
        metadata={"k": 1},
    )


def test_held_samples_round_trip_exactly(tmp_path):
    samples = [sample(0, True, False), sample(1, False, True), sample(2, False, False, with_routing=True)]
    save_held_samples(samples, tmp_path)
    loaded = load_held_samples(tmp_path)
    assert len(loaded) == 3
    assert loaded[2].routed_experts.dtype == np.uint8
    for before, after in zip(samples, loaded):
        for name in ("token_ids", "trained", "sampler_logprobs", "top_ids", "top_logprobs", "routed_experts"):
            left, right = getattr(before, name), getattr(after, name)
            assert (left is None and right is None) or np.array_equal(left, right)
        if before.candidate_sets is None:
            assert after.candidate_sets is None
        else:
            assert all(np.array_equal(a, b) for a, b in zip(before.candidate_sets, after.candidate_sets))
        for name in (
            "advantage",
            "group_id",
            "model_version",
            "row_index",
            "stream_index",
            "epoch",
            "reward",
            "rollout_id",
            "queued_at",
            "metadata",
        ):
            assert getattr(before, name) == getattr(after, name)
    assert load_held_samples(tmp_path / "missing") == []


def test_a_trl_rollout_state_is_read(tmp_path):
    (tmp_path / "rollout_state.json").write_text(json.dumps({"prompt_index": 37, "model_version": 5}))
    state = RolloutState.load(tmp_path)
    assert state.first_untrained_index == 37 and state.model_version == 5 and state.consumed_after == []


def test_restored_held_samples_are_pending_in_the_ledger():
    from asyncgrpo.trainer.intake import SampleIntake

    class Worker:
        def publish_allowance(self, value):
            pass

    ledger = PromptLedger(start_index=3)
    intake = SampleIntake(Worker(), ledger, max_staleness=2, token_budget=64, num_rows=1, rows_per_step=1)
    intake.restore([sample(4, False, False), sample(4, False, False), sample(3, False, False)])
    assert intake.held_samples()[0].stream_index == 4 and ledger.watermark == 3
    for held in intake.held_samples():
        intake._consumed(held, trained=True)
    assert ledger.watermark == 5 and ledger.epoch_prompts == 2


class ScriptedWorker:
    """Hands the intake a fixed list of group results, as the rollout worker's queue would."""

    def __init__(self, results):
        self.results = list(results)

    def publish_allowance(self, value):
        pass

    def next_result(self, timeout):
        return self.results.pop(0) if self.results else None


def group_results(tops_and_samples):
    """One group result per (top reward, samples), row i for the i-th."""
    from asyncgrpo.rollout.messages import GroupResult

    return [
        GroupResult(index, 0, index, index, [sample(index, False, False)] * count, top)
        for index, (top, count) in enumerate(tops_and_samples)
    ]


def intake_fed(tops_and_samples, prompts=4, stop_when_saturated=True):
    """An intake whose worker hands it `group_results(tops_and_samples)`."""
    from asyncgrpo.trainer.intake import SampleIntake

    return SampleIntake(
        ScriptedWorker(group_results(tops_and_samples)),
        PromptLedger(),
        2,
        64,
        num_rows=1,
        rows_per_step=1,
        prompts_per_epoch=prompts,
        stop_when_saturated=stop_when_saturated,
    )


def verdict_of(intake):
    """Check progress as the intake does while waiting: what it returns (TrainingComplete) or raises,
    or None."""
    try:
        return intake._check_progress_possible()
    except Exception as error:  # the verdict under test
        return error


def drain_a_pass(tops_and_samples, prompts=4, stop_when_saturated=True):
    intake = intake_fed(tops_and_samples, prompts, stop_when_saturated)
    intake._drain(0.0)
    return verdict_of(intake)


def test_a_saturated_pass_after_training_ends_the_run_with_its_counts(caplog):
    from asyncgrpo.trainer.intake import TrainingComplete

    # Row 0 trained (its rewards differed, best 1.0); then a pass of 5 prompts: rows 1, 3 and 4 always
    # right, rows 2 and 5 always wrong (reward 0.0 and 0.25 on every rollout).
    verdict = drain_a_pass([(1.0, 2), (1.0, 0), (0.0, 0), (1.0, 0), (1.0, 0), (0.25, 0)], prompts=5)
    assert isinstance(verdict, TrainingComplete), verdict
    assert "the policy always solves 3 (" in caplog.text and "never solves 2 (" in caplog.text
    assert "dataset rows 1, 3, 4" in caplog.text and "(rows 2, 5)" in caplog.text
    assert "Training ends here, as at max_steps" in caplog.text


def test_a_collapsed_policy_after_training_ends_with_nothing_solved(caplog):
    from asyncgrpo.trainer.intake import TrainingComplete

    verdict = drain_a_pass([(1.0, 2)] + [(0.0, 0)] * 3 + [(None, 0)])
    assert isinstance(verdict, TrainingComplete), verdict
    assert "always solves 0 (" in caplog.text and "never solves 3 (" in caplog.text
    assert "1 scored nothing" in caplog.text


def test_a_pass_without_signal_before_any_training_is_an_error():
    from asyncgrpo.trainer.intake import NoTrainingSignalError

    for setting in (True, False):  # a broken setup fails whatever the saturation setting
        verdict = drain_a_pass([(0.0, 0)] * 4, stop_when_saturated=setting)
        assert isinstance(verdict, NoTrainingSignalError), verdict
        assert "Lowest group reward in that pass: 0;" in str(verdict)
        assert "Check the reward functions" in str(verdict)
    verdict = drain_a_pass([(None, 0)] * 4)
    assert "Lowest group reward" not in str(verdict)  # nothing ever scored: no reward to quote


def test_a_pass_without_signal_counts_prompts_in_stream_order_so_a_slow_group_with_samples_breaks_it():
    """Groups finish out of order. The first varying group arrives, then twelve prompts without samples
    (the rest of the first pass of 8 and the whole second pass) while the other three varying groups of
    the first pass are still being scored: no pass without signal yet (a CI run once ended at step 0
    there, the three groups' samples never trained). They arrive, their samples are trained, and the
    twelve prompts after them make a pass."""
    from asyncgrpo.trainer.intake import TrainingComplete

    results = group_results([(1.0, 4)] * 4 + [(1.0, 0)] * 12)
    order = [0, *range(4, 16), 1, 2, 3]
    intake = intake_fed([], prompts=8)
    intake.worker.results.extend(results[index] for index in order[:13])
    intake._drain(0.0)
    assert intake.ledger.prompts_without_samples_streak == 0 and verdict_of(intake) is None
    intake.worker.results.extend(results[index] for index in order[13:])
    intake._drain(0.0)
    assert len(intake.buffer) == 16 and intake.ledger.prompts_without_samples_streak == 12
    intake.buffer.clear()  # trained
    assert isinstance(verdict_of(intake), TrainingComplete)


def test_keep_training_through_saturated_passes_warns_once_a_pass(caplog):
    intake = intake_fed([], stop_when_saturated=False)
    warnings = []
    for result in group_results([(1.0, 2)] + [(1.0, 0)] * 4 + [(0.0, 0)] * 4 + [(1.0, 0)]):
        intake.worker.results.append(result)  # one group at a time, as they arrive while the trainer waits
        intake._drain(0.0)
        assert verdict_of(intake) is None
        warnings.append(caplog.text.count("Training goes on (stop_when_saturated=False)"))
    assert warnings == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]  # after the first pass, then after the second
    first, second = [line for line in caplog.text.splitlines() if "Training goes on" in line]
    assert "always solves 4 (" in first and "never solves 0 (" in first  # rows 1-4
    assert "always solves 0 (" in second and "never solves 4 (" in second  # rows 5-8


def test_a_group_with_samples_restarts_the_streak():
    assert drain_a_pass([(1.0, 0)] * 3 + [(1.0, 2)] + [(1.0, 0)] * 3) is None  # 3 < a pass of 4


def test_data_without_a_length_counts_a_fixed_number_of_prompts_as_a_pass(monkeypatch):
    """Streaming or environment-owned data: a pass without signal is not waited on forever (it was,
    with an environment); without a training step first, it is an error."""
    from asyncgrpo.trainer import intake

    monkeypatch.setattr(intake, "UNBOUNDED_PASS_PROMPTS", 5)
    assert drain_a_pass([(0.0, 0)] * 4, prompts=None) is None  # 4 < 5
    verdict = drain_a_pass([(0.0, 0)] * 5, prompts=None)
    assert isinstance(verdict, intake.NoTrainingSignalError), verdict
    assert "the last 5 prompts (data without a length" in str(verdict)
    saturated = drain_a_pass([(1.0, 2)] + [(0.0, 0)] * 5, prompts=None)
    assert isinstance(saturated, intake.TrainingComplete), saturated


def test_waiting_for_a_rollout_place_is_bounded():
    async def scenario():
        slots = RolloutSlots(1, stall_timeout_s=0.2)
        slots.reserve(2)
        await slots.acquire()
        await slots.acquire()  # nobody releases

    with pytest.raises(RuntimeError, match="none of the 1 running rollouts finished"):
        asyncio.run(scenario())


def test_the_stuck_generation_error_names_what_the_running_rollouts_wait_on():
    board = ActivityBoard()

    async def scenario():
        slots = RolloutSlots(1, stall_timeout_s=0.2, describe_waits=board.describe)
        slots.reserve(2)
        await slots.acquire()
        with board.waiting_on("verify()"):
            await slots.acquire()  # the running rollout waits on a verify that never returns

    with pytest.raises(
        RuntimeError, match=r"generation is stuck \(of the running rollouts, 1 waiting on verify\(\)"
    ):
        asyncio.run(scenario())


def test_the_background_loop_bounds_every_wait():
    loop = BackgroundLoop(default_timeout_s=0.2)
    try:
        with pytest.raises(TimeoutError, match="did not finish within 0.2 s"):
            loop.run(asyncio.sleep(5))
    finally:
        loop.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_the_guard_stops_its_command_when_the_launcher_is_killed(tmp_path):
    """launcher (SIGKILLed) -> guard -> `sleep`: the sleep must not survive its launcher."""
    pid_file = tmp_path / "guarded.pid"
    launcher = subprocess.Popen(
        [sys.executable, "-c", f"""
import os, subprocess, sys, time
command = [sys.executable, "-m", "asyncgrpo.generation.guard", str(os.getpid()), "--", "sleep", "600"]
guard = subprocess.Popen(command, start_new_session=True)
time.sleep(1.0)
open({str(pid_file)!r}, "w").write(str(guard.pid))
time.sleep(600)
"""],
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    guard_pid = int(pid_file.read_text())
    guarded = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == guard_pid]
    assert guarded, "the guard runs its command"
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(5)
    deadline = time.monotonic() + 15
    while (_alive(guard_pid) or any(_alive(p) for p in guarded)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(guard_pid) and not any(_alive(p) for p in guarded)


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1
