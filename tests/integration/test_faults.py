"""Fault injection against the real vLLM CPU server: each test breaks something on purpose and
proves the run survives it, or stops with a clear error, and leaves nothing behind.
The table of faults and behaviours is in docs/reliability.md."""

from __future__ import annotations

import asyncio
import errno
import json
import math
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from support_paths import SUPPORT

pytest.importorskip(
    "datasets", reason="datasets is not installed (a GPU host may lack the non-torch dependencies)"
)
pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

from conftest import TEST_API_KEY, make_config  # noqa: E402
from test_trainer_e2e import PROBE, hf_greedy, restore_server, server_greedy  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402
from worker_side import (  # noqa: E402 (what the rollout worker imports: tests/support/worker_side.py says why)
    MixedRows,
    StuckThreadThenFail,
    broken_judge,
    flaky_judge,
    hanging_reward,
    inf_reward,
    noise_reward,
    prompts,
    token_parity_reward,
)

import asyncgrpo.trainer.checkpoint as checkpoint_module  # noqa: E402
import asyncgrpo.trainer.loss_menu as loss_menu_module  # noqa: E402 (its row_loss: what the loop calls)
from asyncgrpo import AsyncGRPOTrainer  # noqa: E402
from asyncgrpo.cli.main import main as cli_main  # noqa: E402
from asyncgrpo.generation.client import SamplingParams, VLLMClient  # noqa: E402
from asyncgrpo.rollout.prompts import epoch_order  # noqa: E402
from asyncgrpo.rollout.worker import RolloutWorkerError  # noqa: E402
from asyncgrpo.run.lock import DirectoryInUseError  # noqa: E402
from asyncgrpo.trainer.held_samples import load_held_samples  # noqa: E402
from asyncgrpo.trainer.intake import SampleIntake, StepBatch  # noqa: E402
from asyncgrpo.trainer.nonfinite import NonFiniteTrainingError  # noqa: E402

pytestmark = pytest.mark.vllm
FAULT_TRAIN = SUPPORT / "fault_train.py"


@pytest.fixture(autouse=True)
def shared_server_weights_restored(request, tiny_model_dir):
    yield
    if "vllm_server" in request.fixturenames:
        restore_server(request.getfixturevalue("vllm_server").url, tiny_model_dir)


def server_logprobs(url: str) -> np.ndarray:
    async def run():
        async with VLLMClient(url, timeout=60) as client:
            return (
                await client.complete(PROBE, SamplingParams(max_tokens=8, temperature=1.0), seed=0)
            ).logprobs

    return asyncio.run(run())


def history_sum(trainer, name: str) -> float:
    return sum(entry.get(name, 0) for entry in trainer.state.log_history)


# -- the reward side -------------------------------------------------------------------------------


def test_a_reward_that_never_returns_stops_the_run_naming_it(
    vllm_server, tiny_model_dir, tmp_path, monkeypatch
):
    mark = tmp_path / "hang-began"
    monkeypatch.setenv("ASYNCGRPO_TEST_HANG_MARK", str(mark))  # the spawned worker inherits it
    args = make_config(vllm_server, tmp_path, max_steps=3, reward_timeout=3)
    trainer = AsyncGRPOTrainer(str(tiny_model_dir), hanging_reward, args, train_dataset=prompts())
    with pytest.raises(
        RolloutWorkerError,
        match=r"'hanging_reward' did not return within reward_timeout=3 s \(dataset row \d+\)",
    ):
        trainer.train()
    assert time.time() - float(mark.read_text()) < 3 + 10, "stopped within the timeout plus a few seconds"
    assert not any(process.is_alive() for process in trainer.rollout_worker.processes)


def test_an_inf_reward_is_an_error_and_the_served_weights_stay_finite(vllm_server, tiny_model_dir, tmp_path):
    args = make_config(vllm_server, tmp_path, max_steps=3)
    trainer = AsyncGRPOTrainer(str(tiny_model_dir), inf_reward, args, train_dataset=prompts())
    with pytest.raises(RolloutWorkerError, match=r"reward function 'inf_reward' returned inf"):
        trainer.train()
    assert np.all(np.isfinite(server_logprobs(vllm_server.url)))
    assert server_greedy(vllm_server.url) == hf_greedy(trainer.model.eval())


def test_a_reward_that_fails_now_and_then_costs_its_groups_not_the_run(vllm_server, tiny_model_dir, tmp_path):
    args = make_config(vllm_server, tmp_path, max_steps=4)
    trainer = AsyncGRPOTrainer(str(tiny_model_dir), flaky_judge, args, train_dataset=prompts())
    trainer.train()
    assert trainer.state.global_step == 4
    assert history_sum(trainer, "rollout/reward_failed_groups") >= 2, "both failed groups counted"
    warnings = (tmp_path / "warnings.log").read_text()
    assert warnings.count("reward function 'flaky_judge' raised") == 1, "the same error is logged once"
    assert "ConnectionError: the judge answered 503 Service Unavailable" in warnings, "with its traceback"


def test_a_reward_that_always_fails_stops_the_run_naming_it(vllm_server, tiny_model_dir, tmp_path):
    args = make_config(vllm_server, tmp_path, max_steps=3, reward_error_window=4)  # tolerance 0.5: 3 of 4
    trainer = AsyncGRPOTrainer(str(tiny_model_dir), broken_judge, args, train_dataset=prompts())
    with pytest.raises(RolloutWorkerError) as stopped:
        trainer.train()
    message = str(stopped.value)
    assert "reward function 'broken_judge' raised on 3 of the last 3 groups" in message
    assert "reward_error_tolerance=0.5 of reward_error_window=4" in message
    assert "ValueError: the judge's API key was revoked" in message, "its last traceback"
    assert trainer.state.global_step == 0


def poisoned_row_loss(poison_step):
    """row_loss, made NaN on the steps `poison_step(step)` names (one row per step in these runs)."""
    original, calls = loss_menu_module.row_loss, {"step": 0}

    def row_loss(*args, **kwargs):
        loss, stats = original(*args, **kwargs)
        calls["step"] += 1
        return (loss * math.nan if poison_step(calls["step"]) else loss), stats

    return row_loss


def test_nonfinite_steps_are_skipped_and_never_reach_the_server(
    vllm_server, tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(loss_menu_module, "row_loss", poisoned_row_loss(lambda step: step <= 2))
    args = make_config(vllm_server, tmp_path, max_steps=4, learning_rate=1e-2)
    trainer = AsyncGRPOTrainer(str(tiny_model_dir), token_parity_reward, args, train_dataset=prompts())
    initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 4
    assert history_sum(trainer, "train/nonfinite_steps") == 2
    assert all(bool(p.isfinite().all()) for p in trainer.model.parameters())
    assert any(not p.equal(initial[name]) for name, p in trainer.model.named_parameters()), (
        "steps 3-4 trained"
    )
    assert server_greedy(vllm_server.url) == hf_greedy(trainer.model.eval())


def test_three_nonfinite_steps_in_a_row_stop_the_run(vllm_server, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(loss_menu_module, "row_loss", poisoned_row_loss(lambda step: True))
    args = make_config(vllm_server, tmp_path, max_steps=6)
    trainer = AsyncGRPOTrainer(str(tiny_model_dir), token_parity_reward, args, train_dataset=prompts())
    before = server_greedy(vllm_server.url)
    with pytest.raises(NonFiniteTrainingError, match="3 steps in a row"):
        trainer.train()
    assert server_greedy(vllm_server.url) == before == hf_greedy(trainer.model.eval())
    assert np.all(np.isfinite(server_logprobs(vllm_server.url)))


def test_a_stuck_thread_cannot_keep_a_failed_worker_alive():
    from asyncgrpo.rollout.channels import WorkerChannels
    from asyncgrpo.rollout.worker import _worker_main

    context = multiprocessing.get_context("spawn")
    channels = WorkerChannels.create(context)
    inputs = SimpleNamespace(loop=StuckThreadThenFail(), stream=None)  # what WorkerInputs holds
    process = context.Process(target=_worker_main, args=(None, inputs, channels))
    process.start()
    process.join(60)
    assert process.exitcode == 1, "the process left by itself, its stuck thread notwithstanding"
    assert channels.failed_event.is_set()
    name, message, _ = channels.exception_info_queue.get(timeout=10)
    assert (name, message) == ("RuntimeError", "boom after starting a thread that never ends")


# -- bad data -----------------------------------------------------------------------------------------


def test_bad_rows_later_in_the_dataset_are_skipped_and_counted(vllm_server, tiny_model_dir, tmp_path):
    rows = [[{"role": "user", "content": f"Say something about {i}."}] for i in range(8)]
    dataset = MixedRows([{"prompt": row} for row in rows])
    dataset.rows[3] = {"prompt": "a plain string, not messages"}
    dataset.rows[6] = {"prompt": [{"content": "a message without a role"}]}
    args = make_config(vllm_server, tmp_path, num_train_epochs=1, max_steps=-1)
    trainer = AsyncGRPOTrainer(str(tiny_model_dir), token_parity_reward, args, train_dataset=dataset)
    trainer.train()
    # The epoch can end while a good prompt of it is still in flight (a prompt of the next epoch that
    # had nothing to train counts toward it), so look at the bad rows' own stream positions.
    order = epoch_order(len(dataset), args.seed, 0).tolist()
    watermark, resolved_ahead = trainer._run.ledger.state()
    for bad_row in (3, 6):
        position = order.index(bad_row)
        assert position < watermark or position in resolved_ahead, (
            f"bad row {bad_row} was consumed, not retried"
        )
    assert history_sum(trainer, "rollout/skipped_prompts") >= 2


# -- paths and checkpoints ---------------------------------------------------------------------------


def test_a_relative_output_dir_works(vllm_server, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = make_config(vllm_server, "rel_out", max_steps=2, learning_rate=1e-2)
    trainer = AsyncGRPOTrainer(str(tiny_model_dir), token_parity_reward, args, train_dataset=prompts())
    trainer.train()
    assert trainer.state.global_step == 2 and (tmp_path / "rel_out").is_dir()
    assert server_greedy(vllm_server.url) == hf_greedy(trainer.model.eval())


def record_trained(monkeypatch) -> list[tuple[int, str]]:
    """(stream_index, rollout_id) of every sample the trainer takes into a step."""
    trained: list[tuple[int, str]] = []
    original = SampleIntake.next_step

    def recording(self, *args, **kwargs):
        outcome = original(self, *args, **kwargs)  # a batch, or what interrupted taking one
        if isinstance(outcome, StepBatch):
            trained.extend((sample.stream_index, sample.rollout_id) for sample in outcome.samples)
        return outcome

    monkeypatch.setattr(SampleIntake, "next_step", recording)
    return trained


@pytest.mark.parametrize("num_rollout_workers", [1, 2])
def test_resume_across_a_split_group_trains_each_sample_once(
    vllm_server, tiny_model_dir, tmp_path, monkeypatch, num_rollout_workers
):
    # token_budget=64 holds a prompt and two or three completions: every group straddles steps.
    # max_staleness=8: a held sample of version 0 is not dropped as stale before step 6 trains it.
    options = dict(
        max_steps=3, save_strategy="steps", save_steps=3, token_budget=64, num_generations=4, max_staleness=8,
        num_rollout_workers=num_rollout_workers,
    )  # fmt: skip
    first_run = record_trained(monkeypatch)
    AsyncGRPOTrainer(
        str(tiny_model_dir),
        token_parity_reward,
        make_config(vllm_server, tmp_path, **options),
        train_dataset=prompts(60),
    ).train()
    held = load_held_samples(tmp_path / "checkpoint-3")
    assert held, "checkpoint 3 fell inside a group: its untrained samples travel with it"
    monkeypatch.undo()
    second_run = record_trained(monkeypatch)
    options.update(max_steps=6, save_steps=6)
    resumed = AsyncGRPOTrainer(
        str(tiny_model_dir),
        token_parity_reward,
        make_config(vllm_server, tmp_path, **options),
        train_dataset=prompts(60),
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert resumed.state.global_step == 6
    everything = first_run + second_run
    assert len({rollout for _, rollout in everything}) == len(everything), "a sample was trained twice"
    # The checkpoint holds everything the trainer had drained from the worker, which can be more than
    # three steps take: what the second run did not train travels on with checkpoint 6.
    held_at_six = {sample.rollout_id for sample in load_held_samples(tmp_path / "checkpoint-6")}
    trained_second = {rollout for _, rollout in second_run}
    assert {sample.rollout_id for sample in held} <= trained_second | held_at_six, "a held sample was lost"
    assert second_run[0][1] in {sample.rollout_id for sample in held}, "the held samples are trained first"
    per_prompt: dict[int, set[str]] = {}
    for stream_index, rollout in everything:
        per_prompt.setdefault(stream_index, set()).add(rollout)
    assert max(len(rollouts) for rollouts in per_prompt.values()) <= 4, "a split prompt was regenerated"


def _session_processes(session_id: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session_id and fields[0] != "Z":
                found.append(int(entry))
    return found


def _start_fault_run(server, model_dir, output_dir: Path, max_steps: int, mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(FAULT_TRAIN), server.url, str(model_dir), str(output_dir), str(max_steps), mode],
        start_new_session=True,  # its session id finds every process it started, orphans included
        stdout=subprocess.DEVNULL,
        stderr=open(output_dir.parent / f"{output_dir.name}.log", "w"),
    )


def _wait_for(path: Path, process: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, f"the training process exited early ({process.returncode})"
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.5)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_killing_a_training_process_leaves_no_process_behind(vllm_server, tiny_model_dir, tmp_path, sig):
    output = tmp_path / "run"
    output.mkdir()
    process = _start_fault_run(vllm_server, tiny_model_dir, output, 6, "hold-at-2")
    try:
        _wait_for(output / "at-step-2", process)
        assert len(_session_processes(process.pid)) >= 2, "the trainer and its rollout worker are running"
        process.send_signal(sig)
        deadline = time.monotonic() + 15
        while _session_processes(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        process.wait(5)
        assert not _session_processes(process.pid), "processes outlived the killed trainer by 15 s"
    finally:
        for pid in _session_processes(process.pid):
            os.kill(pid, signal.SIGKILL)
    if sig == signal.SIGTERM:
        assert not (output / ".vllm_weights").exists(), "SIGTERM ran the cleanup Ctrl-C runs"


def test_a_kill_during_a_checkpoint_save_resumes_from_the_previous_one(vllm_server, tiny_model_dir, tmp_path):
    output = tmp_path / "run"
    output.mkdir()
    process = _start_fault_run(vllm_server, tiny_model_dir, output, 6, "slow-save-at-3")
    try:
        _wait_for(output / "saving-3", process)
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    finally:
        for pid in _session_processes(process.pid):
            os.kill(pid, signal.SIGKILL)
    assert (output / ".checkpoint-3.partial").is_dir() and not (output / "checkpoint-3").exists()
    assert get_last_checkpoint(str(output)) == str(output / "checkpoint-2")
    args = make_config(
        vllm_server, output, max_steps=4, save_strategy="steps", save_steps=1, learning_rate=1e-3
    )
    resumed = AsyncGRPOTrainer(str(tiny_model_dir), token_parity_reward, args, train_dataset=prompts(60))
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    assert (output / "checkpoint-4").is_dir() and not (output / ".checkpoint-3.partial").exists()


def test_a_second_run_in_a_live_runs_directory_is_refused_and_the_first_finishes(
    vllm_server, tiny_model_dir, tmp_path
):
    output = tmp_path / "run"
    output.mkdir()
    # Made before the first run starts: construction finds the directory free, train() must not.
    early = AsyncGRPOTrainer(
        str(tiny_model_dir),
        token_parity_reward,
        make_config(vllm_server, output, max_steps=2),
        train_dataset=prompts(),
    )
    process = _start_fault_run(vllm_server, tiny_model_dir, output, 4, "wait-at-2")
    try:
        _wait_for(output / "at-step-2", process, seconds=900)
        config = (output / "config.json").read_text()
        live = f"pid {process.pid} on host {socket.gethostname()}"
        with pytest.raises(
            DirectoryInUseError, match=re.escape(f"{output} is in use by another live run ({live}")
        ):
            AsyncGRPOTrainer(
                str(tiny_model_dir),
                token_parity_reward,
                make_config(vllm_server, output),
                train_dataset=prompts(),
            )
        with pytest.raises(DirectoryInUseError, match=live):
            early.train()
        assert (output / "config.json").read_text() == config, "the live run's config.json is its own"
        assert list((output / ".vllm_weights").iterdir()), "the live run's weight files are there"
        (output / "release").touch()
        assert process.wait(900) == 0, "the first run trained to its end"
    finally:
        for pid in _session_processes(process.pid):
            os.kill(pid, signal.SIGKILL)
    assert get_last_checkpoint(str(output)) == str(output / "checkpoint-4")


def test_a_full_disk_at_a_save_then_a_resume_after_a_cut_record_leave_a_readable_run(
    vllm_server, tiny_model_dir, tmp_path, monkeypatch
):
    options = dict(max_steps=4, save_strategy="steps", save_steps=1, save_total_limit=2)
    write_held_samples = checkpoint_module.save_held_samples

    def disk_full_from_step_3(samples, directory):
        if Path(directory).name in (".checkpoint-3.partial", ".checkpoint-4.partial"):
            raise OSError(errno.ENOSPC, "No space left on device")
        write_held_samples(samples, directory)

    monkeypatch.setattr(checkpoint_module, "save_held_samples", disk_full_from_step_3)
    first = AsyncGRPOTrainer(
        str(tiny_model_dir),
        token_parity_reward,
        make_config(vllm_server, tmp_path, **options),
        train_dataset=prompts(),
    )
    # Step 3's save fails and is retried at step 4, which fails, and once more at the end: the run stops.
    with pytest.raises(OSError, match="No space left on device") as full:
        first.train()
    assert "3 save(s) in a row failed" in " ".join(full.value.__notes__)
    monkeypatch.undo()
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    assert not list(tmp_path.glob(".checkpoint-*")), "the failed saves gave their space back"
    with open(tmp_path / "metrics.jsonl", "a") as metrics:
        metrics.write('{"step": 3, "reward": 0.2')  # what a run killed mid-write leaves
    resumed = AsyncGRPOTrainer(
        str(tiny_model_dir),
        token_parity_reward,
        make_config(vllm_server, tmp_path, **options),
        train_dataset=prompts(),
    )
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4 and (tmp_path / "checkpoint-4").is_dir()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert all(isinstance(json.loads(line), dict) for line in lines), "every line is a whole record"
    assert cli_main(["report", str(tmp_path)]) == 0 and (tmp_path / "report.html").exists()


# -- the server side ------------------------------------------------------------------------------------


def test_a_server_killed_and_restarted_mid_run_is_given_the_weights_and_training_finishes(
    keyed_server, vllm_servers, tiny_model_dir, tmp_path, monkeypatch
):
    # The suite's keyed server (every route but liveness requires the key): the client sends
    # VLLM_API_KEY on every call, the restarted server included. Restarted with the same options
    # (key and port), it stays the pool's server for the tests after this one.
    monkeypatch.setenv("VLLM_API_KEY", TEST_API_KEY)
    server = keyed_server
    restarted = threading.Event()

    def restart() -> None:
        time.sleep(3)
        server.start()  # the same port
        restarted.set()

    class KillServerAtStep2(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                os.killpg(server.process.pid, signal.SIGKILL)  # the server's whole process group
                server.process.wait()
                threading.Thread(target=restart, daemon=True).start()
            elif state.global_step == 3:
                # Steps 4-6 must train on rollouts the restarted server made: with max_staleness=1
                # generation holds one step's worth ahead, so the run cannot finish on its queue
                # while the server is still starting (a loaded machine starts it slowly).
                assert restarted.wait(timeout=600), "the killed server did not start again"

    try:
        args = make_config(
            server,
            tmp_path / "out",
            max_steps=6,
            learning_rate=1e-2,
            vllm_server_timeout=240,
            max_staleness=1,
        )
        # Rewards that never saturate: at this learning rate the parity reward can leave a whole pass
        # without signal after a few steps, which ends the run before step 6 (docs/reliability.md).
        trainer = AsyncGRPOTrainer(
            str(tiny_model_dir),
            noise_reward,
            args,
            train_dataset=prompts(),
            callbacks=[KillServerAtStep2()],
        )
        trainer.train()
        assert restarted.is_set() and trainer.state.global_step == 6
        assert history_sum(trainer, "rollout/server_restarts") >= 1
        assert server_greedy(server.url) == hf_greedy(trainer.model.eval()), (
            "the restarted server runs the trained weights"
        )
    finally:
        if server.process is None or server.process.poll() is not None or not restarted.is_set():
            vllm_servers.release(api_key=TEST_API_KEY)  # a later test gets a fresh one
