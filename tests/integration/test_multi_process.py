"""Several training processes on CPU (torchrun, gloo): FSDP2 sharding applied by the trainer, one
row per process, gradients reduced, weights gathered for the sync."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support_paths import SUPPORT

pytest.importorskip(
    "datasets", reason="datasets is not installed (a GPU host may lack the non-torch dependencies)"
)

import torch  # noqa: E402
from conftest import free_port  # noqa: E402
from test_trainer_e2e import restore_server, server_greedy  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from asyncgrpo.checkpoints.layout import ShardedManifest  # noqa: E402
from asyncgrpo.cli.main import main as cli_main  # noqa: E402
from asyncgrpo.cli.run_config import parse_overrides  # noqa: E402
from asyncgrpo.config import AsyncGRPOConfig  # noqa: E402
from asyncgrpo.generation.client import VLLMClient, parse_policy_label  # noqa: E402

# The two-node test starts two servers of its own beside the session's.
pytestmark = pytest.mark.many_servers

HERE = SUPPORT


def torchrun(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(free_port()), str(HERE / script), *args]
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_fsdp2_loss_and_gradients_match_one_process():
    """Rank r trains on row r of a micro-batch; the summed loss and the reduced gradients equal one
    unsharded process training on both rows (the trainer's `row_loss`: the score-centered loss, then
    dapo with the KL to a sharded reference copy and the entropy mask's threshold over both rows)."""
    result = torchrun("fsdp_loss_worker.py", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("max grad diff") == 4  # two ranks, two losses


def torchrun_two_nodes(script: str, *args: str, timeout: float) -> list[subprocess.CompletedProcess]:
    """Two `torchrun --nnodes 2` launches, one process each, meeting through torch's c10d rendezvous
    on localhost: what a two-node job runs, one launch per node (docs/scaling.md)."""
    endpoint = f"127.0.0.1:{free_port()}"
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    launches = []
    for node_rank in range(2):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
        command += ["--node-rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
        command += ["--rdzv-id", "two-nodes", str(HERE / script), *args]
        launches.append(
            subprocess.Popen(
                command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    return _finish(launches, timeout)


def accelerate_two_machines(script: str, *args: str, timeout: float) -> list[subprocess.CompletedProcess]:
    """Two `accelerate launch --num_machines 2` launches (TRL's FSDP2 config, one process each) on
    localhost: what a two-node job runs with accelerate, one launch per node (docs/scaling.md)."""
    port = str(free_port())
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    launches = []
    for machine_rank in range(2):
        command = [sys.executable, "-m", "accelerate.commands.launch"]
        command += ["--config_file", str(HERE / "trl_example" / "fsdp2.yaml"), "--num_machines", "2"]
        command += ["--num_processes", "2", "--machine_rank", str(machine_rank)]
        command += ["--main_process_ip", "127.0.0.1", "--main_process_port", port, str(HERE / script), *args]
        launches.append(
            subprocess.Popen(
                command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    return _finish(launches, timeout)


def _finish(launches: list[subprocess.Popen], timeout: float) -> list[subprocess.CompletedProcess]:
    results = []
    try:
        for launch in launches:
            stdout, stderr = launch.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(launch.args, launch.returncode, stdout, stderr))
    finally:
        for launch in launches:
            launch.kill()
    return results


def server_labels(urls: list[str]) -> list[str]:
    async def run():
        async with VLLMClient(urls, timeout=60) as client:
            return await client.weight_labels()

    return asyncio.run(run())


@pytest.mark.vllm
def test_two_nodes_train_evaluate_checkpoint_and_resume_against_two_servers(
    vllm_server, lora_server, tiny_model_dir, tmp_path, monkeypatch
):
    """Two "nodes" on localhost (gloo, one rank each, FSDP2 across them) train against two vLLM
    servers: every server runs every pushed version, and a checkpoint resumes. The first run is launched
    the accelerate way (TRL's documented FSDP2 config with `--num_machines 2`), the resumed one the
    torchrun way (two `torchrun --nnodes 2` launches): each launcher starts a job that trains, syncs
    every server and checkpoints or resumes, and a checkpoint written under one resumes under the other.
    The run evaluates after every step and calls evaluate() from a callback on both ranks: rank 0
    samples, both ranks log the same figures, once, at the steps a single process would."""
    monkeypatch.setenv("ASYNCGRPO_TEST_EVAL", "1")
    servers = [vllm_server.url, lora_server.url]
    before = [server_greedy(url) for url in servers]
    try:
        first = accelerate_two_machines(
            "multi_process_train.py", ",".join(servers), str(tiny_model_dir), str(tmp_path), "2", timeout=600
        )
        assert [launch.returncode for launch in first] == [0, 0], (
            first[0].stderr[-5000:] + first[1].stderr[-3000:]
        )
        after = [server_greedy(url) for url in servers]
        labels_after_first = server_labels(servers)
        checkpoint = tmp_path / "checkpoint-2"
        second = torchrun_two_nodes(
            "multi_process_train.py",
            ",".join(servers),
            str(tiny_model_dir),
            str(tmp_path),
            "4",
            str(checkpoint),
            timeout=600,
        )
        assert [launch.returncode for launch in second] == [0, 0], second[0].stderr[-5000:]
        labels_after_second = server_labels(servers)
    finally:
        for url in servers:
            restore_server(url, tiny_model_dir)
    # Both servers hold the same, newest weights after each run: the sync reached every server.
    assert after[0] == after[1] and after != before, (before, after)
    assert len(set(labels_after_first)) == 1 and len(set(labels_after_second)) == 1
    first_version, second_version = (
        parse_policy_label(labels[0]) for labels in (labels_after_first, labels_after_second)
    )
    assert first_version is not None and second_version is not None and second_version > first_version
    steps = [entry for entry in json.loads((tmp_path / "history-2.json").read_text()) if "loss" in entry]
    assert [entry["step"] for entry in steps] == [1, 2]
    assert all(entry["batch/samples_per_step"] > 0 and entry["grad_norm"] > 0 for entry in steps)
    # The checkpoint is sharded: each process wrote its own shards of the model and of every parameter's
    # moments; exported, it is the whole model a single process loads.
    assert ShardedManifest.load(checkpoint).world_size == 2
    assert {"__0_0.distcp", "__1_0.distcp"} <= {path.name for path in (checkpoint / "shards").iterdir()}
    written = FileSystemReader(str(checkpoint / "shards")).read_metadata().state_dict_metadata
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert all(f"optim.state.{name}.exp_avg" in written for name, _ in initial.named_parameters())
    assert cli_main(["export", str(checkpoint), str(tmp_path / "exported")]) == 0
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    assert all(p.shape == q.shape for p, q in zip(saved.parameters(), initial.parameters()))
    assert any(not torch.equal(p, q) for p, q in zip(saved.parameters(), initial.parameters()))
    # save_model at the end of a run on two processes: the consolidated model, the last checkpoint's.
    assert cli_main(["export", str(tmp_path / "checkpoint-4"), str(tmp_path / "exported-4")]) == 0
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "model-4").state_dict()
    assert final.keys() == initial.state_dict().keys()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported-4").state_dict()
    assert all(torch.equal(final[name], exported[name]) for name in final)
    # Resuming continues the steps, the prompts and the policy version (and loads that optimizer state).
    resumed = [entry for entry in json.loads((tmp_path / "history-4.json").read_text()) if "loss" in entry]
    assert [entry["step"] for entry in resumed] == [1, 2, 3, 4]  # the restored history, then 3 and 4
    state_2 = json.loads((checkpoint / "rollout_state.json").read_text())
    state_4 = json.loads((tmp_path / "checkpoint-4" / "rollout_state.json").read_text())
    assert state_4["epoch_prompts"] > state_2["epoch_prompts"] > 0
    assert state_4["model_version"] > state_2["model_version"]
    # The servers run the version the last checkpoint recorded: the resumed run pushed on from there.
    assert second_version == state_4["model_version"]
    assert_evaluations_of_two_ranks(tmp_path)


def assert_evaluations_of_two_ranks(run: Path) -> None:
    """The evaluations of the two-node run (tests/support/multi_process_train.py with
    ASYNCGRPO_TEST_EVAL=1)."""

    def evaluations(history: str, prefix: str = "eval") -> dict[int, dict]:
        entries = json.loads((run / history).read_text())
        return {entry["step"]: entry for entry in entries if f"{prefix}_reward" in entry}

    # After every step, at its own step's weights; the resumed run at steps 3 and 4, as one run would.
    assert sorted(evaluations("history-2.json")) == [1, 2]
    measured = evaluations("history-4.json")
    assert sorted(measured) == [1, 2, 3, 4]
    for step, entry in measured.items():
        assert entry["eval_model_version"] == step
        # The counts by hand (EVAL_PASSES): a single process reports these; an eval set split between
        # the ranks, or sampled twice, would not.
        assert entry["eval_reward"] == pytest.approx(3 / 6)
        assert entry["eval_pass@1"] == pytest.approx((0 + 1 / 2 + 1) / 3)
        assert entry["eval_pass@2"] == pytest.approx(2 / 3)
    # Rank 1 logs the figures rank 0 measured (its callbacks and report_to see them too).
    assert evaluations("history-4-rank1.json") == measured
    # evaluate() called by a callback on both ranks mid-run: collective, no rank left waiting.
    called = evaluations("history-4.json", "mid")
    assert sorted(called) == [3] and called == evaluations("history-4-rank1.json", "mid")
    assert called[3]["mid_pass@2"] == pytest.approx(2 / 3) and called[3]["mid_model_version"] == 3
    # metrics.jsonl (rank 0's): each evaluation once, across the first run and the resumed one.
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "eval_reward" in line] == [1, 2, 3, 4]


def test_slurm_example_is_valid_bash_and_its_overrides_parse():
    """The SLURM example parses as bash, and the overrides it hands `asyncgrpo train` are ones the
    command line accepts."""
    script = HERE.parents[1] / "examples" / "slurm" / "train.sbatch"
    for each in (script, script.with_name("add_server.sbatch")):
        assert subprocess.run(["bash", "-n", str(each)], capture_output=True).returncode == 0, each
    text = script.read_text()
    assert "-m asyncgrpo.cli train" in text and "--rdzv-backend c10d" in text
    assert "--vllm_server_urls_file" in text
    overrides = parse_overrides(
        ["--vllm_server_base_url", "http://a:8000,http://b:8000", "--vllm_server_urls_file", "/x/servers.txt"]
        + ["--output_dir", "/x"]
    )
    config = AsyncGRPOConfig(**overrides)
    assert config.vllm_server_urls == ["http://a:8000", "http://b:8000"]
    assert config.vllm_server_urls_file == "/x/servers.txt"
