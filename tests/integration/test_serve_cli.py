"""`asyncgrpo serve`: the flags it adds, the command it prints, and no server left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

from conftest import free_port  # noqa: E402

from asyncgrpo.generation.server import ServerOptions, build_command, server_environment  # noqa: E402


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    # build_command reads the model's config to pick family flags; for a made-up model id ("m") an
    # online lookup would only wait for the Hub's timeouts (about 24 s per test on this machine).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_cpu_command_and_environment():
    argv, env = build_command(
        ServerOptions(model="m", port=8123, max_model_len=512, cpu=True, extra_args=["--seed", "3"])
    )
    joined = " ".join(argv)
    assert "serve m --host 127.0.0.1 --port 8123" in joined
    assert "--logprobs-mode processed_logprobs" in joined and "--generation-config vllm" in joined
    assert "--enforce-eager" in argv and "--weight-transfer-config" not in argv
    assert argv[-2:] == ["--seed", "3"] and "--max-model-len 512" in joined
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    # The model runs inside the engine core (no worker process of its own) unless the user says.
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_a_users_multiprocessing_choice_reaches_a_cpu_server_unchanged(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    _, env = build_command(ServerOptions(model="m", cpu=True))
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert server_environment(env)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_gpu_and_lora_command():
    argv, env = build_command(
        ServerOptions(model="m", cpu=False, enable_lora=True, max_lora_rank=32, max_loras=6)
    )
    assert argv[argv.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'
    assert "--enforce-eager" not in argv
    assert argv[argv.index("--max-lora-rank") + 1] == "32" and argv[argv.index("--max-loras") + 1] == "6"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env


def test_routing_replay_asks_for_routed_experts_on_gpu_and_is_refused_on_cpu():
    argv, _ = build_command(ServerOptions(model="m", cpu=False, return_routed_experts=True))
    assert "--enable-return-routed-experts" in argv
    assert "--enable-return-routed-experts" not in build_command(ServerOptions(model="m", cpu=False))[0]
    with pytest.raises(ValueError, match="vLLM-CPU 0.32 cannot return routed experts"):
        build_command(ServerOptions(model="m", cpu=True, return_routed_experts=True))


def _children(pid: int) -> set[int]:
    """Every process whose parent chain leads to `pid` (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _launch_serve(model_dir) -> tuple[subprocess.Popen, int]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "asyncgrpo.cli", "serve", str(model_dir), "--port", str(port),
         "--max-model-len", "256", "--cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    return process, port


def _wait_until_serving(port: int, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1)
    pytest.fail("the server did not start")


@pytest.mark.vllm
def test_serve_prints_the_command_and_a_kill_leaves_no_process(tiny_model_dir):
    """SIGTERM stops the server with `asyncgrpo serve`; SIGKILL (which `asyncgrpo serve` cannot catch)
    too: the guard it runs the server under notices its launcher is gone. The two servers start side
    by side, so the suite pays for one start."""
    launched = {sig: _launch_serve(tiny_model_dir) for sig in (signal.SIGTERM, signal.SIGKILL)}
    try:
        for process, _ in launched.values():
            printed = process.stdout.readline()
            assert "VLLM_SERVER_DEV_MODE=1" in printed and "--logprobs-mode processed_logprobs" in printed
        children = {}
        for sig, (process, port) in launched.items():
            _wait_until_serving(port)
            children[sig] = _children(process.pid)
            assert children[sig], "vllm serve runs as a child process"
        for sig, (process, _) in launched.items():
            process.send_signal(sig)
            assert process.wait(timeout=30) is not None
        deadline = time.monotonic() + 15
        left = [pid for pids in children.values() for pid in pids]
        while time.monotonic() < deadline and any(_alive(pid) for pid in left):
            time.sleep(0.2)
        for sig, pids in children.items():
            survivors = [pid for pid in pids if _alive(pid)]
            assert not survivors, f"processes outlived `asyncgrpo serve` after {signal.Signals(sig).name}"
    finally:
        for process, _ in launched.values():
            if process.poll() is None:
                process.kill()


def test_serve_enable_lora_picks_the_lora_flags_from_the_run_settings(monkeypatch):
    from asyncgrpo import cli

    seen = {}

    def serve_foreground(options):
        seen["o"] = options
        return 0

    monkeypatch.setattr("asyncgrpo.generation.server.serve_foreground", serve_foreground)
    cli.main(["serve", "m", "--enable-lora", "--lora-rank", "12", "--max-staleness", "2"])
    assert (seen["o"].max_lora_rank, seen["o"].max_loras) == (16, 4)
    seen.clear()
    cli.main(["serve", "m", "--enable-lora"])  # the trainer's default max_staleness=4; vLLM's default rank
    assert (seen["o"].max_lora_rank, seen["o"].max_loras) == (None, 6)
    seen.clear()
    cli.main(["serve", "m", "--enable-lora", "--lora-rank", "4", "--max-lora-rank", "64", "--max-loras", "9"])
    assert (seen["o"].max_lora_rank, seen["o"].max_loras) == (64, 9)  # explicit flags win
    seen.clear()
    cli.main(["serve", "m", "--max-staleness", "2"])
    assert (seen["o"].enable_lora, seen["o"].max_loras) == (False, None)


# -- a first run of `asyncgrpo serve`: no forced offline mode, --dry-run, --for with a MODEL ---------------


def test_a_hub_model_is_served_online_and_a_local_one_offline(monkeypatch, tmp_path):
    """A Hub id must download on a fresh machine: offline mode only when the user set it, or when the
    model is a local directory (vLLM then needs no Hub, and a lookup would only wait for a timeout)."""
    monkeypatch.setattr("asyncgrpo.generation.server.model_flags", lambda *_: ([], []))
    monkeypatch.delenv("HF_HUB_OFFLINE")
    _, env = build_command(ServerOptions(model="Qwen/Qwen3.5-2B", cpu=True))
    assert "HF_HUB_OFFLINE" not in env
    _, env = build_command(ServerOptions(model=str(tmp_path), cpu=True))
    assert env["HF_HUB_OFFLINE"] == "1"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the user's choice stays theirs (inherited, not overridden)
    _, env = build_command(ServerOptions(model=str(tmp_path), cpu=True))
    assert "HF_HUB_OFFLINE" not in env


def test_dry_run_prints_the_command_and_starts_nothing(monkeypatch, capsys):
    from asyncgrpo import cli

    started = []
    monkeypatch.setattr("asyncgrpo.generation.server.serve_foreground", started.append)
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: started.append(a))
    for argv in (
        ["serve", "--dry-run", "m", "--cpu"],
        ["serve", "m", "--max-model-len", "512", "--api-server-count", "8", "--dry-run", "--cpu"],
        ["serve", "--dry-run", "--for", "examples/quickstart.yaml", "--cpu"],
    ):
        assert cli.main(argv) == 0, argv
        printed = capsys.readouterr().out.strip().splitlines()
        assert len(printed) == 1 and "VLLM_SERVER_DEV_MODE=1" in printed[0], printed
    assert started == []
    cli.main(["serve", "--dry-run", "m", "--max-model-len", "512", "--api-server-count", "8", "--cpu"])
    command = capsys.readouterr().out
    assert " serve m " in command and "--max-model-len 512" in command
    assert command.strip().endswith("--api-server-count 8")


def test_serve_for_a_config_with_a_model_serves_that_model_alone(capsys):
    from asyncgrpo import cli

    assert cli.main(["serve", "--for", "examples/quickstart.yaml", "my/model", "--dry-run", "--cpu"]) == 0
    argv = capsys.readouterr().out.split()
    assert argv[argv.index("serve") + 1] == "my/model"
    assert "Qwen/Qwen3.5-2B" not in argv and "my/model" not in argv[argv.index("serve") + 2 :]
    # A vllm flag's value is never taken for the model: without a model, the config's.
    for_config = ["serve", "--for", "examples/quickstart.yaml"]
    assert cli.main([*for_config, "--api-server-count", "8", "--dry-run"]) == 0
    argv = capsys.readouterr().out.split()
    assert argv[argv.index("serve") + 1] == "Qwen/Qwen3.5-2B" and argv[-2:] == ["--api-server-count", "8"]


def _distillation_config(tmp_path, **changes):
    """A distillation config with two teachers, `math` of a known model and `code` of none."""
    import yaml

    config = {
        "trainer": "distillation",
        "model": "student/model",
        "dataset": {"data_files": "examples/data/addition.jsonl"},
        "vllm_server_base_url": "http://localhost:8100",
        "teacher_server_urls": {"math": "http://localhost:9001", "code": "http://localhost:9002"},
        "teacher_models": {"math": "teacher/math"},
        **changes,
    }
    path = tmp_path / "distill.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


def test_serve_for_a_teacher_prints_its_command_with_the_flags_a_teacher_needs(tmp_path, capsys):
    from asyncgrpo import cli

    config = _distillation_config(tmp_path, teacher_top_k=30, token_budget=512)
    assert cli.main(["serve", "--for", config, "--teacher", "math", "--dry-run", "--cpu"]) == 0
    (printed,) = capsys.readouterr().out.strip().splitlines()
    argv = printed.split()
    assert argv[argv.index("serve") + 1] == "teacher/math" and "--port 9001" in printed
    # teacher_top_k candidates plus the realized token; a sample plus the one token a scoring generates.
    assert "--max-logprobs 31" in printed and "--max-model-len 513" in printed
    assert "--logprobs-mode processed_logprobs" in printed  # teacher_temperature reaches the log-probs
    # Never sent weights: no dev-mode routes, no LoRA.
    assert "VLLM_SERVER_DEV_MODE" not in printed and "--enable-lora" not in printed
    # A model typed on the command line serves a teacher the config names no model for.
    assert cli.main(["serve", "--for", config, "--teacher", "code", "other/code", "--dry-run", "--cpu"]) == 0
    printed = capsys.readouterr().out
    assert " serve other/code " in printed and "--port 9002" in printed


def test_a_teachers_server_on_gpu_has_no_weight_transfer(tmp_path):
    from asyncgrpo.cli.run_config import build_run_config, read_config
    from asyncgrpo.cli.train_command import server_options_for, teacher_server_options

    run = build_run_config(read_config(_distillation_config(tmp_path)))
    teacher_argv, teacher_env = build_command(teacher_server_options(run, "math", cpu=False))
    student_argv, student_env = build_command(server_options_for(run, cpu=False))
    assert "--weight-transfer-config" in student_argv and student_env["VLLM_SERVER_DEV_MODE"] == "1"
    assert "--weight-transfer-config" not in teacher_argv and "VLLM_SERVER_DEV_MODE" not in teacher_env
    assert teacher_argv[teacher_argv.index("--max-logprobs") + 1] == "9"  # teacher_top_k=8 (TRL's) + 1


def test_a_dry_run_for_a_distillation_config_lists_the_student_and_each_teacher(tmp_path, capsys):
    from asyncgrpo import cli

    config = _distillation_config(tmp_path)
    assert cli.main(["serve", "--for", config, "--dry-run", "--cpu"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "# the student's server (sent weights)"
    assert " serve student/model " in lines[1] and "--port 8100" in lines[1] and "DEV_MODE=1" in lines[1]
    assert lines[2] == "# teacher 'math' at http://localhost:9001 (never sent weights)"
    assert " serve teacher/math " in lines[3] and "--port 9001" in lines[3]
    # A teacher whose model the config does not name: how to serve it.
    assert lines[4].startswith("# teacher 'code' at http://localhost:9002 (never sent weights): its model")
    assert lines[5] == f"#   asyncgrpo serve --for {config} --teacher code MODEL"
    assert len(lines) == 6


def test_serve_for_a_teacher_refuses_what_it_cannot_serve(tmp_path, capsys):
    from asyncgrpo import cli

    config = _distillation_config(tmp_path)
    assert cli.main(["serve", "--for", config, "--teacher", "code", "--dry-run"]) == 2
    assert "teacher 'code' has no model: set `teacher_models: {code: MODEL}`" in capsys.readouterr().out
    assert cli.main(["serve", "--for", config, "--teacher", "physics", "--dry-run"]) == 2
    assert "--teacher physics: the config has no such teacher (teacher_server_urls: math, code)" in (
        capsys.readouterr().out
    )
    assert cli.main(["serve", "--teacher", "math", "m", "--dry-run"]) == 2
    assert "--teacher ID needs --for CONFIG.yaml" in capsys.readouterr().out


def test_serve_for_a_teacher_runs_the_command_it_prints(tmp_path, capsys, monkeypatch):
    from asyncgrpo import cli
    from asyncgrpo.generation.server import format_command

    argv = ["serve", "--for", _distillation_config(tmp_path), "--teacher", "math", "--cpu"]
    assert cli.main([*argv, "--dry-run"]) == 0
    printed = capsys.readouterr().out.strip()
    served = []
    monkeypatch.setattr("asyncgrpo.generation.server.serve_foreground", served.append)
    cli.main(argv)
    assert "(teacher math)" in capsys.readouterr().out
    assert format_command(*build_command(served[0])) == printed


@pytest.mark.vllm
def test_a_teacher_served_as_serve_for_starts_it_scores_a_sample(tiny_model_dir, tmp_path):
    """The teacher's server as `serve --for CONFIG --teacher ID` starts it (no dev-mode routes, no weight
    transfer) answers the teacher client: its tokenizer, and teacher_top_k candidates beyond vLLM's
    default cap of 20, plus the realized token."""
    import asyncio

    import numpy as np

    from asyncgrpo.cli.run_config import build_run_config, read_config
    from asyncgrpo.cli.train_command import teacher_server_options
    from asyncgrpo.generation.server import VLLMServer
    from asyncgrpo.generation.teacher_client import TeacherClient

    url = f"http://127.0.0.1:{free_port()}"
    config = _distillation_config(
        tmp_path,
        teacher_server_urls={"math": url},
        teacher_models={"math": str(tiny_model_dir)},
        teacher_top_k=30,
    )
    options = teacher_server_options(build_run_config(read_config(config)), "math", cpu=True)

    async def score():
        client = TeacherClient(url, timeout=60, request_timeout=60)
        try:
            token_ids = await client.tokenize("one two three four five")
            positions = np.arange(1, len(token_ids))
            return token_ids, positions, await client.prompt_logprobs(token_ids, positions, 30, 1.0)
        finally:
            await client.close()

    with VLLMServer(options, log_path=tmp_path / "teacher.log"):
        token_ids, positions, (ids, logprobs) = asyncio.run(score())
    assert ids.shape == (len(positions), 31)
    assert (ids[:, :30] >= 0).all() and np.isfinite(logprobs[:, :30]).all()  # all 30 candidates reported
    for row, position in enumerate(positions):
        assert token_ids[position] in ids[row]  # the realized token, among them or after them
