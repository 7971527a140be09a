"""Runs that last for days, without a server: one live run per directory (the lock and its stale
cases), checkpoints that survive a save interrupted at each point, run files that any reader can read
after a crash and that stay bounded for any run length (docs/reliability.md)."""

from __future__ import annotations

import errno
import json
import logging
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

import asyncgrpo.run.durable_files as durable_files  # noqa: E402
import asyncgrpo.trainer.checkpoint as checkpoint_module  # noqa: E402
import asyncgrpo.trainer.checkpoint_saves as checkpoint_saves  # noqa: E402
from asyncgrpo.checkpoints.layout import ShardedManifest  # noqa: E402
from asyncgrpo.report.history import load_run  # noqa: E402
from asyncgrpo.run import files as run_files
from asyncgrpo.run import timeline  # noqa: E402
from asyncgrpo.run.files import RUN_LOCK_FILE, attach_warnings_file, detach_warnings_file  # noqa: E402
from asyncgrpo.run.lock import DirectoryInUseError, Owner, OwnerLock, boot_id  # noqa: E402
from asyncgrpo.trainer.run_directory import hold_run_directory, repair_jsonl  # noqa: E402

# -- one live run per directory -------------------------------------------------------------------------

HOLD_A_LOCK = """
import sys, time
from asyncgrpo.run.lock import OwnerLock
OwnerLock(sys.argv[1], ".asyncgrpo-run.lock").acquire()
print("held", flush=True)
time.sleep(3600)
"""


def test_a_live_owner_is_refused_by_name_and_a_killed_ones_lock_is_taken_over(tmp_path, caplog):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_LOCK, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DirectoryInUseError) as refused:
            OwnerLock(tmp_path, RUN_LOCK_FILE).acquire(refusal="Use another output_dir.")
        message = str(refused.value)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in message and str(tmp_path) in message
        assert message.endswith("Use another output_dir.")
    finally:
        holder.kill()  # SIGKILL: no clean-up, the lock file stays behind
        holder.wait()
    assert (tmp_path / RUN_LOCK_FILE).exists()
    lock = OwnerLock(tmp_path, RUN_LOCK_FILE)
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.run.lock"):
        lock.acquire()
    assert lock.held() and f"pid {holder.pid}" in caplog.text, "the dead run's lock, taken over"
    lock.release()
    assert not (tmp_path / RUN_LOCK_FILE).exists()


def _plant_lock(directory: Path, host: str, boot: str, age_s: float) -> Path:
    path = directory / RUN_LOCK_FILE
    owner = Owner(pid=4242, host=host, boot_id=boot, token="theirs", since=time.time() - age_s)
    path.write_text(json.dumps(owner.__dict__))
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_a_lock_from_another_machine_counts_until_its_heartbeat_stops(tmp_path):
    lock = OwnerLock(tmp_path, RUN_LOCK_FILE, stale_after_s=60)
    _plant_lock(tmp_path, "another-node", "another-boot", age_s=5)  # its heartbeat is recent
    with pytest.raises(DirectoryInUseError, match="pid 4242 on host another-node"):
        lock.acquire()
    _plant_lock(tmp_path, "another-node", "another-boot", age_s=600)  # no heartbeat for 10 minutes
    lock.acquire()
    assert lock.held()
    lock.release()
    # This host's name but another boot (a reboot, or a machine sharing the name): its heartbeat decides.
    _plant_lock(tmp_path, socket.gethostname(), "a-boot-before-this-one", age_s=600)
    lock.acquire()
    lock.release()
    assert boot_id(), "Linux says which boot this is"


def test_without_flock_the_heartbeat_decides(tmp_path, monkeypatch):
    """Some network and FUSE mounts have no flock: a lock is then live while its heartbeat is."""
    import fcntl

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    first = OwnerLock(tmp_path, RUN_LOCK_FILE, stale_after_s=60)
    first.acquire()
    with pytest.raises(DirectoryInUseError, match=f"pid {os.getpid()}"):
        OwnerLock(tmp_path, RUN_LOCK_FILE, stale_after_s=60).acquire()
    first.abandon()  # dead, its heartbeat stopped
    os.utime(first.path, (time.time() - 600, time.time() - 600))
    second = OwnerLock(tmp_path, RUN_LOCK_FILE, stale_after_s=60)
    second.acquire()
    assert second.held()
    second.release()


def test_the_heartbeat_refreshes_the_lock_and_notices_a_takeover(tmp_path):
    lock = OwnerLock(tmp_path, RUN_LOCK_FILE, heartbeat_s=0.05)
    lock.acquire()
    try:
        os.utime(lock.path, (0, 0))
        deadline = time.monotonic() + 30
        while lock.path.stat().st_mtime < time.time() - 60:
            assert time.monotonic() < deadline, "the heartbeat never touched the lock"
            time.sleep(0.05)
        _plant_lock(tmp_path, "another-node", "another-boot", age_s=0)  # what a racing taker leaves
        while not lock.lost:
            assert time.monotonic() < deadline, "the heartbeat never saw another record"
            time.sleep(0.05)
        assert not lock.held()
    finally:
        lock.release()
    assert lock.path.exists(), "the other owner's file is not removed"


def test_the_shared_memory_folders_use_the_same_lock(tmp_path):
    from asyncgrpo.weight_sync.shared_memory import OWNER_LOCK, owned_directory, remove_orphans

    directory, lock = owned_directory(tmp_path)
    assert json.loads((directory / OWNER_LOCK).read_text())["pid"] == os.getpid()
    assert remove_orphans(tmp_path) == []
    lock.abandon()
    assert remove_orphans(tmp_path) == [directory]


# -- checkpoints interrupted at each point ---------------------------------------------------------------
# Each test runs on both layouts (asyncgrpo/checkpoints/layout.py): the full one, written by rank 0 while
# the step waits, and the sharded one, whose shards and rename happen in a background thread.


class Crash(BaseException):
    """Where the test stops a save, as a kill or a power loss would."""


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.fixture(params=["full", "sharded"])
def layout(request) -> str:
    return request.param


@pytest.fixture
def trainer(tiny_model_dir, tmp_path, layout):
    """A trainer that can write checkpoints (no server: nothing here trains), and its checkpoints of
    the parametrized layout (`trainer.checkpoints`)."""
    from datasets import Dataset

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.records.metrics import MetricsWindow
    from asyncgrpo.trainer.checkpoint_saves import RunCheckpoints
    from asyncgrpo.trainer.distributed import Processes

    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "run"),
        report_to="none",
        max_steps=10,
        save_total_limit=2,
        save_strategy="steps",
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "q"}]]})
    trainer = AsyncGRPOTrainer(str(tiny_model_dir), zero_reward, args, train_dataset=dataset)
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    trainer.checkpoints = RunCheckpoints(Processes(1, 0), layout, True, False, MetricsWindow(), lock=None)
    yield trainer
    trainer.callback_handler.on_train_end(args, trainer.state, trainer.control)


def restart(trainer) -> None:
    """What the next run starts with after a kill: checkpoints of its own (the stopped save is gone)."""
    from asyncgrpo.records.metrics import MetricsWindow
    from asyncgrpo.trainer.checkpoint_saves import RunCheckpoints

    old = trainer.checkpoints
    trainer.checkpoints = RunCheckpoints(old.processes, old.layout, True, False, MetricsWindow(), lock=None)


def save(trainer, step: int, watermark: int, wait: bool = True) -> None:
    """A checkpoint of `step`; `wait`: until it is settled (a sharded save is written in the background)."""
    from asyncgrpo.trainer.checkpoint import ResumePoint
    from asyncgrpo.trainer.prompt_ledger import RolloutState

    trainer.state.global_step = step
    resume = ResumePoint(RolloutState(first_untrained_index=watermark))
    trainer.checkpoints.save(trainer, trainer.model, None, resume)
    if wait:
        trainer.checkpoints.wait()


@contextmanager
def stopped_in(monkeypatch, target, name: str):
    """The save stops inside `target.name` as a killed process would: on the training thread it raises
    Crash there; in the background writer it blocks there (the files stay as they are) until the block
    ends, then raises Crash, so that the writer never goes on. Yields an event set once it is reached."""
    reached, release = threading.Event(), threading.Event()

    def stop(*args, **kwargs):
        reached.set()
        if threading.current_thread() is not threading.main_thread():
            release.wait(120)
        raise Crash()

    monkeypatch.setattr(target, name, stop)
    try:
        yield reached
    finally:
        release.set()


def save_stopped(trainer, step: int, watermark: int, reached: threading.Event) -> None:
    """A save of `step` that stops where `stopped_in` says (on either thread)."""
    try:
        save(trainer, step, watermark, wait=False)
    except Crash:
        pass
    assert reached.wait(60), "the save never reached the point where it is stopped"


def resumes_from(run: Path) -> tuple[str, int]:
    """What the next start finds: the checkpoint `resume_from_checkpoint=True` picks, and its rollout
    state's watermark, after the start's clean-up (the whole checkpoint must load)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncgrpo.checkpoints.layout import ShardedManifest, is_sharded
    from asyncgrpo.checkpoints.sharded_state import load_training_state
    from asyncgrpo.trainer.checkpoint import read_resume_point

    hold_run_directory(run).release()
    last = get_last_checkpoint(str(run))
    if is_sharded(last):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(last))  # weights: the shards
        load_training_state(model, None, last, ShardedManifest.load(last), distributed=False)
    else:
        AutoModelForCausalLM.from_pretrained(last)
    return Path(last).name, read_resume_point(last, streaming=False).rollout.first_untrained_index


def patch_rotation(monkeypatch, replacement) -> None:
    monkeypatch.setattr(checkpoint_module, "rotate_checkpoints", replacement)  # the full layout's
    monkeypatch.setattr(checkpoint_saves, "rotate_checkpoints", replacement)  # the sharded layout's


def test_every_file_is_on_disk_before_the_rename_and_the_rename_before_rotation(trainer, monkeypatch):
    run = Path(trainer.args.output_dir)
    save(trainer, 1, watermark=10)
    log: list[tuple[str, str]] = []
    fsync_path, replace = durable_files.fsync_path, os.replace
    monkeypatch.setattr(
        durable_files, "fsync_path", lambda path: (log.append(("fsync", str(path))), fsync_path(path))
    )
    monkeypatch.setattr(os, "replace", lambda a, b: (log.append(("rename", f"{a} -> {b}")), replace(a, b)))
    rotate = checkpoint_saves.rotate_checkpoints
    patch_rotation(monkeypatch, lambda **kw: (log.append(("rotate", "")), rotate(**kw)))
    save(trainer, 2, watermark=20)
    staging = str(run / ".checkpoint-2.partial")
    published = next(
        i for i, (kind, what) in enumerate(log) if kind == "rename" and what.startswith(staging + " ")
    )
    synced = {what for kind, what in log[:published] if kind == "fsync"}
    written = {str(path) for path in (run / "checkpoint-2").rglob("*")} | {str(run / "checkpoint-2")}
    assert {path.replace("checkpoint-2", ".checkpoint-2.partial") for path in written} <= synced
    assert log[published + 1] == ("fsync", str(run)), "the rename is made durable at once"
    assert [kind for kind, _ in log].index("rotate") > published + 1, "older checkpoints go only after"


def test_a_save_killed_before_its_fsync_leaves_the_previous_checkpoint(trainer, monkeypatch):
    run = Path(trainer.args.output_dir)
    save(trainer, 1, watermark=10)
    with stopped_in(monkeypatch, durable_files, "fsync_tree") as reached:
        save_stopped(trainer, 2, 20, reached)
        assert (run / ".checkpoint-2.partial").is_dir() and not (run / "checkpoint-2").exists()
        monkeypatch.undo()
        assert resumes_from(run) == ("checkpoint-1", 10)
        assert not (run / ".checkpoint-2.partial").exists(), "the next start clears what the save left"


# The stages of a sharded save before its rename, where a kill leaves the previous checkpoint the last one.
SHARDED_SAVE_STAGES = {
    "rank 0's small files": (checkpoint_module, "save_held_samples"),
    "the shards, before their metadata": (FileSystemWriter, "finish"),
    "the manifest": (ShardedManifest, "save"),
}


@pytest.mark.parametrize("layout", ["sharded"])
@pytest.mark.parametrize("stage", sorted(SHARDED_SAVE_STAGES))
def test_a_sharded_save_killed_at_each_stage_leaves_the_previous_checkpoint(trainer, monkeypatch, stage):
    run = Path(trainer.args.output_dir)
    save(trainer, 1, watermark=10)
    with stopped_in(monkeypatch, *SHARDED_SAVE_STAGES[stage]) as reached:
        save_stopped(trainer, 2, 20, reached)
        assert (run / ".checkpoint-2.partial").is_dir() and not (run / "checkpoint-2").exists()
        monkeypatch.undo()
        assert resumes_from(run) == ("checkpoint-1", 10)
        assert not (run / ".checkpoint-2.partial").exists(), "the next start clears what the save left"


def test_a_save_killed_between_its_rename_and_the_rotation_resumes_from_the_new_one(trainer, monkeypatch):
    run = Path(trainer.args.output_dir)
    for step in (1, 2):
        save(trainer, step, watermark=10 * step)
    with stopped_in(monkeypatch, checkpoint_module, "rotate_checkpoints") as reached:
        monkeypatch.setattr(checkpoint_saves, "rotate_checkpoints", checkpoint_module.rotate_checkpoints)
        save_stopped(trainer, 3, 30, reached)
        monkeypatch.undo()
        assert sorted(path.name for path in run.glob("checkpoint-*")) == [
            "checkpoint-1",
            "checkpoint-2",
            "checkpoint-3",
        ]
        assert resumes_from(run) == ("checkpoint-3", 30)
    restart(trainer)
    save(trainer, 4, watermark=40)
    assert sorted(path.name for path in run.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]


def test_a_checkpoint_saved_again_always_has_a_complete_copy(trainer, monkeypatch):
    """A resumed run that saves a step again (an earlier checkpoint resumed explicitly) replaces it: a
    crash between moving the old copy aside and renaming the new one puts the old one back."""
    run = Path(trainer.args.output_dir)
    save(trainer, 1, watermark=10)
    replace = os.replace
    reached, release = threading.Event(), threading.Event()

    def crash_before_the_new_copy_arrives(a, b):
        if Path(a).name == ".checkpoint-1.partial":
            reached.set()
            if threading.current_thread() is not threading.main_thread():
                release.wait(120)
            raise Crash()
        replace(a, b)

    monkeypatch.setattr(durable_files.os, "replace", crash_before_the_new_copy_arrives)
    try:
        save_stopped(trainer, 1, 11, reached)
        monkeypatch.undo()
        assert (run / ".checkpoint-1.replaced").is_dir() and not (run / "checkpoint-1").exists()
        assert resumes_from(run) == ("checkpoint-1", 10), "the old copy, put back"
    finally:
        release.set()
    restart(trainer)
    save(trainer, 1, watermark=11)
    assert resumes_from(run) == ("checkpoint-1", 11) and not list(run.glob(".checkpoint-*"))


def test_a_full_disk_during_a_save_is_retried_and_three_in_a_row_stop_the_run(trainer, monkeypatch, caplog):
    """A full disk (in the background writer, for a sharded save): the save's staging directory is
    removed, the earlier checkpoints stay, the failure is reported and the next step saves again; a
    save that succeeds ends the count, three failures in a row stop the run with the disk's error."""
    run = Path(trainer.args.output_dir)
    save(trainer, 1, watermark=10)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if trainer.checkpoints.layout == "sharded":  # the shards, written by the background thread
        monkeypatch.setattr(FileSystemWriter, "write_data", disk_full)
    else:
        monkeypatch.setattr(checkpoint_module, "save_held_samples", disk_full)
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.checkpoints.failures"):
        save(trainer, 2, watermark=20)
    assert "the checkpoint of step 2 could not be written" in caplog.text and "No space left" in caplog.text
    assert trainer.checkpoints.retry_due, "the next step saves again"
    assert not (run / ".checkpoint-2.partial").exists(), "the space it took is given back"
    assert resumes_from(run) == ("checkpoint-1", 10)
    monkeypatch.undo()
    save(trainer, 3, watermark=30)  # the retry, at the next step: the disk has room again
    assert not trainer.checkpoints.retry_due and resumes_from(run) == ("checkpoint-3", 30)
    if trainer.checkpoints.layout == "sharded":
        monkeypatch.setattr(FileSystemWriter, "write_data", disk_full)
    else:
        monkeypatch.setattr(checkpoint_module, "save_held_samples", disk_full)
    save(trainer, 4, watermark=40)
    save(trainer, 5, watermark=50)
    with pytest.raises(OSError, match="No space left") as full:
        save(trainer, 6, watermark=60)
    notes = " ".join(full.value.__notes__)
    assert "3 save(s) in a row failed" in notes and "the checkpoints written before it are kept" in notes
    monkeypatch.undo()
    assert resumes_from(run) == ("checkpoint-3", 30) and not list(run.glob(".checkpoint-*"))


# -- run files after a crash -----------------------------------------------------------------------------


def test_metrics_jsonl_is_cut_after_its_last_whole_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    whole = '{"step": 1, "reward": 0.5}\n{"step": 2, "reward": 0.6}\n'
    for tail, dropped in (("", 0), ('{"step": 3, "rew', 16), ("\0" * 64, 64), ('{"step": 3}\n\0\0\0', 3)):
        path.write_text(whole + tail)
        assert repair_jsonl(path) == dropped
        kept = whole + ('{"step": 3}\n' if tail.startswith('{"step": 3}\n') else "")
        assert path.read_text() == kept
    assert repair_jsonl(tmp_path / "absent.jsonl") == 0


def test_the_report_reads_a_file_that_a_resume_appended_to_without_repair(tmp_path):
    """What runs before the repair left: a partial record with the resumed run's first glued to it."""
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "reward": 0.5}\n{"step": 2, "rew{"step": 2, "reward": 0.7}\n'
        '{"step": 3, "reward": 0.8}\n\0\0'
    )
    (tmp_path / "config.json").write_text("")  # emptied by a power loss
    history = load_run(tmp_path)
    assert history.series("reward") == ([1, 2, 3], [0.5, 0.7, 0.8]) and history.config == {}
    (tmp_path / "metrics.jsonl").unlink()  # a run that crashed before its first logging window
    with pytest.raises(FileNotFoundError, match="logged no step yet"):
        load_run(tmp_path)


# -- bounded run files ---------------------------------------------------------------------------------------


def test_the_timeline_stays_within_its_bound_over_many_steps_and_is_written_off_the_training_thread(tmp_path):
    recorder = timeline.TimelineRecorder(tmp_path / "timeline.json", write_interval_s=0.0)
    timeline.activate(recorder)
    writers = []
    render = recorder._render
    recorder._render = lambda: (writers.append(threading.current_thread()), render())[1]
    try:
        for step in range(1, 100_001):
            recorder.begin_step(step)
            timeline.interval("step", 0, 1)
            if step % 20_000 == 0:
                recorder.write_if_due()
    finally:
        timeline.activate(None)
    recorder.write()
    trace = json.loads(recorder.path.read_text())
    kept = trace["otherData"]["steps_kept"]
    bound = 1 + timeline.FIRST_STEPS_KEPT + timeline.SAMPLED_STEPS_KEPT + timeline.LAST_STEPS_KEPT
    assert len(kept) <= bound and kept[-1] == 100_000 and kept[:3] == [0, 1, 2]
    middle = [step for step in kept if timeline.FIRST_STEPS_KEPT < step <= 100_000 - timeline.LAST_STEPS_KEPT]
    assert len(middle) >= timeline.SAMPLED_STEPS_KEPT // 2 and middle[0] < 10_000, "spread over the whole run"
    assert any(thread is not threading.main_thread() for thread in writers), "written by a thread of its own"
    small = timeline.TimelineRecorder(tmp_path / "small.json", max_file_bytes=4000)
    timeline.activate(small)
    try:
        for step in range(1, 200):
            small.begin_step(step)
            for _ in range(10):
                timeline.interval("rollout", 0, 1, lane="request 0")
    finally:
        timeline.activate(None)
    small.write()
    assert small.path.stat().st_size <= 4000 + 1000  # the cap, and the metadata and trailer around it
    assert json.loads(small.path.read_text())["otherData"]["steps_over_size_cap"] > 0


def _warn_many(path: str, count: int, max_bytes: int) -> None:
    run_files.WARNINGS_FILE_MAX_BYTES = max_bytes
    attach_warnings_file(path)  # what the rollout worker does first
    for index in range(count):
        logging.getLogger("asyncgrpo.rollout.loop").warning("worker warning %d %s", index, "x" * 150)


def test_warnings_log_stays_within_its_bound_with_two_writing_processes(tmp_path, monkeypatch):
    monkeypatch.setattr(run_files, "WARNINGS_FILE_MAX_BYTES", 20_000)
    path = tmp_path / "warnings.log"
    handler = attach_warnings_file(path, background=True)
    try:
        worker = multiprocessing.get_context("spawn").Process(
            target=_warn_many, args=(str(path), 600, 20_000)
        )
        worker.start()
        for index in range(600):
            logging.getLogger("asyncgrpo.trainer.intake").warning("trainer warning %d %s", index, "y" * 150)
        worker.join(120)
        assert worker.exitcode == 0
        logging.getLogger("asyncgrpo.trainer.intake").warning("the last warning")
    finally:
        detach_warnings_file()
    assert handler.max_bytes == 20_000
    sizes = [path.stat().st_size, Path(f"{path}.1").stat().st_size]
    assert max(sizes) <= 20_000 and min(sizes) > 0, sizes
    text = path.read_text() + Path(f"{path}.1").read_text()
    assert "the last warning" in text and "worker warning 599" in text, "the newest warnings are kept"
