"""Soak: a long CPU run of the tiny model through the faults a run of days meets, and what it costs.

    .venv/bin/python bench/soak.py [--minutes 60] [--work DIR] [--server-kills 4]

One vLLM CPU server and one training run of the tiny model (token-parity reward, a checkpoint every
20 steps, two kept). During the run the driver SIGKILLs the server and restarts it on the same port
(`--server-kills` times, spread over the run), and SIGTERMs the trainer twice (at 15% and 30% of the
run) and resumes it with `resume_from_checkpoint=True`; at the end it asks the last run to stop and
save. The trainer records its own prompt ledger (every group it took, every sample trained or
dropped, every checkpoint written) into `record-N.jsonl`; the records of a killed run are kept up to
the checkpoint the next run resumed from, the rest being the steps lost. From that lineage:

- twice: prompts with more resolved samples than `num_generations`, or a rollout trained twice;
- skipped: prompts the final checkpoint counts as done (below its watermark, or resolved after it)
  with no sample trained or dropped and no group without samples in the lineage.

Every 30 s it samples the trainer's and the rollout worker's RSS, open file descriptors and threads,
the entries of the trainer's own temp directory (the TMPDIR of the trainer and everything it starts;
the server gets another, so what vLLM leaves behind when it is SIGKILLed is counted apart), the
/dev/shm entries the trainer's processes (and, apart, the server's) have open or mapped, and the run
files' sizes. Growth is measured in the
last run (the one after the second SIGTERM), from ten minutes into it (a third of it, when shorter)
to its end. Prints the details, and last:

    soak hours=H steps=S twice=0 skipped=0 rss_growth_mb=X fds_growth=Y files_mb=Z

rss_growth_mb and fds_growth add the trainer's and the worker's; files_mb is the run directory's run
files (config.json, metrics.jsonl, warnings.log*, timeline.json). Targets: twice=0, skipped=0, RSS
growth under 5%, no growth of descriptors, threads, temp entries or /dev/shm entries.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

GENERATIONS = 4
SAVE_STEPS = 20
DATASET_ROWS = 5000
TRAINER_KILLS_AT = (0.15, 0.30)  # fractions of the run
SAMPLE_EVERY_S = 30.0
BASELINE_AFTER_S = 600.0  # the first ten minutes of the last run are its warm-up
RUN_FILES = ("config.json", "metrics.jsonl", "warnings.log", "warnings.log.1", "timeline.json")


def token_parity_reward(completion_ids, **kwargs):
    """The tests' reward: the share of even token ids (cheap, and never the same for every sample)."""
    return [sum(1 for token in ids if token % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


# -- one training run (a child process the driver SIGTERMs) ------------------------------------------------


def run_segment(work: Path, url: str, model: str, segment: int, resume: bool) -> None:
    from datasets import Dataset
    from transformers import TrainerCallback

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.trainer.intake import SampleIntake, StepBatch
    from asyncgrpo.trainer.prompt_ledger import PromptLedger

    record = open(work / f"record-{segment}.jsonl", "a", buffering=1)  # noqa: SIM115 - for the run's life

    def note(**event) -> None:
        record.write(json.dumps(event) + "\n")

    add_group, sample_done, next_step = (
        PromptLedger.add_group,
        PromptLedger.sample_done,
        SampleIntake.next_step,
    )

    def recording_add_group(self, stream_index, num_samples):
        note(e="group", i=int(stream_index), n=int(num_samples))
        return add_group(self, stream_index, num_samples)

    def recording_sample_done(self, stream_index, trained):
        note(e="done", i=int(stream_index), t=bool(trained))
        return sample_done(self, stream_index, trained)

    def recording_next_step(self, *args, **kwargs):
        outcome = next_step(self, *args, **kwargs)  # a batch, or what interrupted taking one
        for sample in outcome.samples if isinstance(outcome, StepBatch) else []:
            note(e="trained", i=int(sample.stream_index), r=sample.rollout_id)
        return outcome

    PromptLedger.add_group, PromptLedger.sample_done = recording_add_group, recording_sample_done
    SampleIntake.next_step = recording_next_step

    class Marks(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            note(e="begin", step=state.global_step, time=time.time())

        def on_step_end(self, args, state, control, **kwargs):
            note(e="step", step=state.global_step)
            if (work / "stop").exists():  # the driver's end of the soak: stop, with a checkpoint
                control.should_training_stop = control.should_save = True

        def on_save(self, args, state, control, **kwargs):
            note(e="saved", step=state.global_step)

    rows = [[{"role": "user", "content": f"Say something about {i}."}] for i in range(DATASET_ROWS)]
    config = AsyncGRPOConfig(
        output_dir=str(work / "run"),
        vllm_server_base_url=url,
        num_generations=GENERATIONS,
        max_completion_length=16,
        token_budget=256,
        gradient_checkpointing=False,
        logging_steps=10,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        save_total_limit=2,
        report_to="none",
        disable_tqdm=True,
        vllm_server_timeout=300,
        max_steps=10**7,  # the driver ends the run
        learning_rate=1e-6,  # the policy barely moves: hours of training keep a signal in every pass
        seed=0,
    )
    trainer = AsyncGRPOTrainer(
        model,
        token_parity_reward,
        config,
        train_dataset=Dataset.from_dict({"prompt": rows}),
        callbacks=[Marks()],
    )
    trainer.train(resume_from_checkpoint=True if resume else None)
    record.close()


# -- what the driver measures -------------------------------------------------------------------------------


def read_records(path: Path) -> list[dict]:
    events = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            events.append(json.loads(line))
        except ValueError:
            continue  # a line cut by the SIGTERM
    return events


def lineage(segments: list[list[dict]]) -> tuple[list[dict], int]:
    """The events that count (each killed run's up to the checkpoint the next one resumed from) and
    the steps lost (reached by a killed run beyond that checkpoint)."""
    kept, lost = [], 0
    for index, events in enumerate(segments):
        if index + 1 == len(segments):
            kept += events
            break
        resumed = next(event["step"] for event in segments[index + 1] if event["e"] == "begin")
        reached = max((event["step"] for event in events if event["e"] == "step"), default=0)
        # The checkpoint's own mark; a SIGTERM between its rename and the mark leaves only the step's
        # end, after which nothing of the ledger moved before the save.
        marks = [
            position
            for position, event in enumerate(events)
            if (event["e"] in ("saved", "step") and event["step"] == resumed)
            or (event["e"] == "begin" and resumed == 0)
        ]
        cut = marks[-1]
        kept += events[: cut + 1]
        lost += reached - resumed
    return kept, lost


def prompt_accounting(
    events: list[dict], rollout_state: dict, generations: int
) -> tuple[list[int], list[int]]:
    """(prompts trained twice, prompts skipped): see the module's docstring."""
    done, trained = Counter(), Counter()
    resolved = set()
    for event in events:
        if event["e"] == "done":
            done[event["i"]] += 1
            resolved.add(event["i"])
        elif event["e"] == "group" and event["n"] == 0:
            resolved.add(event["i"])
        elif event["e"] == "trained":
            trained[(event["i"], event["r"])] += 1
    twice = {index for index, count in done.items() if count > generations}
    twice |= {index for (index, _), count in trained.items() if count > 1}
    expected = set(range(rollout_state["first_untrained_index"])) | set(rollout_state["consumed_after"])
    return sorted(twice), sorted(expected - resolved)


def _status(pid: int) -> dict[str, int]:
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "Threads"):
                fields[name] = int(value.split()[0])
        fields["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError):
        return {}
    return fields


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as file:
            return [int(child) for child in file.read().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += _children(current)
    return found


def _shm_entries(pids: list[int]) -> set[str]:
    """/dev/shm entries these processes have open or mapped, and that are still there (a named
    semaphore of multiprocessing is unlinked as soon as it is made: mapped, it holds no entry)."""
    entries = set()
    for pid in pids:
        try:
            for name in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{name}")
                if target.startswith("/dev/shm/") and not target.endswith(" (deleted)"):
                    entries.add(target)
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                if "/dev/shm/" in line and not line.endswith(" (deleted)"):
                    entries.add(line[line.index("/dev/shm/") :])
        except OSError:
            continue
    return entries


def run_file_sizes(work: Path) -> dict[str, int]:
    run = work / "run"
    return {name: (run / name).stat().st_size for name in RUN_FILES if (run / name).exists()}


def sample(work: Path, trainer_pid: int, server_pid: int) -> dict:
    worker = next((pid for pid in _children(trainer_pid) if "spawn_main" in _cmdline(pid)), None)
    return {
        "time": time.time(),
        "trainer": _status(trainer_pid),
        "worker": _status(worker) if worker else {},
        "temp_entries": len(os.listdir(work / "tmp")),
        "server_temp_entries": len(os.listdir(work / "tmp-server")),
        "shm_entries": len(_shm_entries(_descendants(trainer_pid))),
        "server_shm_entries": len(server_shm := _shm_entries(_descendants(server_pid))),
        "server_shm_names": sorted(server_shm),
        "files": run_file_sizes(work),
    }


# -- the driver --------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--work", type=Path, default=None, help="kept after the run (default: a temp dir)")
    parser.add_argument("--server-kills", type=int, default=4)
    parser.add_argument("--report", type=Path, help="only print the figures of a finished soak's work dir")
    # One training run, started by the driver: work dir, server URL, model dir, run index.
    parser.add_argument("--segment", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.report:
        return report(args.report)
    if args.segment:
        work, url, model, index = args.segment
        run_segment(Path(work), url, model, int(index), resume=int(index) > 0)
        return 0
    return drive(args.minutes * 60, args.work or Path(tempfile.mkdtemp(prefix="soak-")), args.server_kills)


def drive(duration_s: float, work: Path, server_kills: int) -> int:
    from asyncgrpo.generation.server import ServerOptions, VLLMServer

    work.mkdir(parents=True, exist_ok=True)
    for stale in ("run", "tmp", "tmp-server", "stop"):
        shutil.rmtree(work / stale, ignore_errors=True)
    for stale in work.glob("record-*.jsonl"):
        stale.unlink()
    (work / "tmp").mkdir()
    (work / "tmp-server").mkdir()
    env = {**os.environ, "TMPDIR": str(work / "tmp"), "PYTHONPATH": str(HERE.parent)}
    model = work / "model"
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "tiny-model", str(model)], check=True, env=env)
    options = ServerOptions(model=str(model), port=free_port(), max_model_len=1024, dtype="float32", cpu=True)
    server = VLLMServer(options, log_path=work / "server.log")
    os.environ["TMPDIR"] = str(work / "tmp-server")  # the server inherits it
    server.start()
    started = time.time()
    server_kill_times = [started + duration_s * (k + 1) / (server_kills + 1) for k in range(server_kills)]
    trainer_kill_times = [started + duration_s * fraction for fraction in TRAINER_KILLS_AT]
    segments: list[subprocess.Popen] = []
    samples = open(work / "samples.jsonl", "w", buffering=1)  # noqa: SIM115 - closed below

    def take_sample() -> None:
        figures = sample(work, trainer.pid, server.process.pid)
        samples.write(json.dumps({"segment": len(segments) - 1, "started": started, **figures}) + "\n")

    def start_segment() -> subprocess.Popen:
        index = len(segments)
        log = open(work / f"segment-{index}.log", "w")  # noqa: SIM115 - the child owns it
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--segment",
            str(work),
            server.url,
            str(model),
            str(index),
        ]
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        segments.append(process)
        print(
            f"[{(time.time() - started) / 60:5.1f} min] trainer run {index} started (pid {process.pid})",
            flush=True,
        )
        return process

    trainer = start_segment()
    next_sample = time.time()
    try:
        while time.time() < started + duration_s:
            now = time.time()
            if trainer.poll() is not None:
                raise RuntimeError(
                    f"trainer run {len(segments) - 1} exited ({trainer.returncode}): see its log"
                )
            if server_kill_times and now >= server_kill_times[0]:
                server_kill_times.pop(0)
                os.killpg(server.process.pid, signal.SIGKILL)
                server.process.wait()
                print(f"[{(now - started) / 60:5.1f} min] server killed", flush=True)
                time.sleep(3)
                server.start()  # the same port
                print(f"[{(time.time() - started) / 60:5.1f} min] server back", flush=True)
            if trainer_kill_times and now >= trainer_kill_times[0] and _saved_once(work, len(segments) - 1):
                trainer_kill_times.pop(0)
                trainer.send_signal(signal.SIGTERM)
                trainer.wait(timeout=300)
                print(
                    f"[{(time.time() - started) / 60:5.1f} min] trainer SIGTERMed ({trainer.returncode})",
                    flush=True,
                )
                trainer = start_segment()
            if now >= next_sample:
                take_sample()
                next_sample = now + SAMPLE_EVERY_S
            time.sleep(1)
        take_sample()  # the end
        (work / "stop").touch()
        trainer.wait(timeout=900)
    finally:
        for process in segments:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        server.stop()
    if trainer.returncode != 0:
        raise RuntimeError(f"the last trainer run exited with {trainer.returncode}: see its log")
    samples.close()
    return report(work)


def free_port() -> int:
    """A free port on loopback (closed again before the server binds it)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _saved_once(work: Path, segment: int) -> bool:
    return any(event["e"] == "saved" for event in read_records(work / f"record-{segment}.jsonl"))


def report(work: Path) -> int:
    """The soak's figures, from what the run left in `work` (also after the fact: --report WORK)."""
    samples = [(figures["segment"], figures) for figures in read_records(work / "samples.jsonl")]
    segments = sorted(work.glob("record-*.jsonl"), key=lambda path: int(path.stem.split("-")[1]))
    started = samples[0][1]["started"]
    last_start = next(event["time"] for event in read_records(segments[-1]) if event["e"] == "begin")
    records = [read_records(path) for path in segments]
    kept, lost = lineage(records)
    checkpoints = sorted((work / "run").glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    rollout_state = json.loads((checkpoints[-1] / "rollout_state.json").read_text())
    twice, skipped = prompt_accounting(kept, rollout_state, GENERATIONS)
    steps = max(event["step"] for event in records[-1] if event["e"] == "step")
    last = [figures for segment, figures in samples if segment == len(segments) - 1 and figures["trainer"]]
    baseline_time = last_start + min(BASELINE_AFTER_S, (last[-1]["time"] - last_start) / 3)
    baseline = next(figures for figures in last if figures["time"] >= baseline_time)
    end = last[-1]

    window = [figures for figures in last if figures["time"] >= baseline["time"]]

    halves = (window[: len(window) // 2], window[len(window) // 2 :])

    def at_rest(figures: list[dict], process: str, field: str) -> int:
        # Connections come and go with the requests in flight: the floor over half the window.
        return min(sample.get(process, {}).get(field, 0) for sample in figures)

    def growth(process: str, field: str) -> int:
        if field == "VmRSS":
            return end[process].get(field, 0) - baseline[process].get(field, 0)
        return at_rest(halves[1], process, field) - at_rest(halves[0], process, field)

    hours = (end["time"] - started) / 3600
    resumed = [next(event["step"] for event in run if event["e"] == "begin") for run in records]
    print(f"trainer runs: {len(segments)}, starting at steps {resumed}; steps lost to the SIGTERMs: {lost}")
    print(f"prompts the final checkpoint counts as done: {rollout_state['first_untrained_index']}")
    if twice or skipped:
        print(f"prompts trained twice: {twice[:20]}; skipped: {skipped[:20]}")
    since = (baseline["time"] - last_start) / 60
    for process in ("trainer", "worker"):
        before, after = baseline[process], end[process]
        fds = [sample[process].get("fds", 0) for sample in window]
        threads = [sample[process].get("Threads", 0) for sample in window]
        print(
            f"{process}: RSS {before.get('VmRSS', 0) / 1024:.1f} -> {after.get('VmRSS', 0) / 1024:.1f} MB, "
            f"threads {before.get('Threads')} -> {after.get('Threads')} (at most {max(threads)}), fds "
            f"{before.get('fds')} -> {after.get('fds')} ({min(fds)}-{max(fds)}; the floor of each half "
            f"{at_rest(halves[0], process, 'fds')} -> {at_rest(halves[1], process, 'fds')}), from "
            f"{since:.1f} min into the last run to its end"
        )
    first = samples[0][1]
    for side, who in (("", "trainer and worker"), ("server_", "server")):
        temp, shm = side + "temp_entries", side + "shm_entries"
        print(
            f"{who}: temp entries {first[temp]} at the start, {baseline[temp]} -> {end[temp]}; "
            f"/dev/shm entries held {first[shm]} at the start, {baseline[shm]} -> {end[shm]}"
        )
    seen = {name for _, figures in samples for name in figures.get("server_shm_names", [])}
    left = [Path(name) for name in sorted(seen) if Path(name).exists()]
    print(
        f"/dev/shm entries the servers held that outlived them: {len(left)} "
        f"({sum(path.stat().st_size for path in left) / 2**20:.0f} MiB)"
        + ("" if seen or not samples else " (not recorded by this soak)")
    )
    files = run_file_sizes(work)  # after the last run ended
    print("run files (bytes): " + ", ".join(f"{name} {size}" for name, size in files.items()))
    rss_growth = (growth("trainer", "VmRSS") + growth("worker", "VmRSS")) / 1024
    rss_base = (baseline["trainer"].get("VmRSS", 0) + baseline["worker"].get("VmRSS", 0)) / 1024
    print(
        f"RSS growth {rss_growth:+.1f} MB of {rss_base:.0f} MB ({100 * rss_growth / max(rss_base, 1):+.1f}%)"
    )
    print(
        f"soak hours={hours:.2f} steps={steps} twice={len(twice)} skipped={len(skipped)} "
        f"rss_growth_mb={rss_growth:.1f} fds_growth={growth('trainer', 'fds') + growth('worker', 'fds')} "
        f"files_mb={sum(files.values()) / 2**20:.1f}",
        flush=True,
    )
    return 0 if not twice and not skipped else 1


if __name__ == "__main__":
    sys.exit(main())
