"""Several training processes on CPU (torchrun, gloo): FSDP2 sharding applied by the trainer, one
row per process, gradients reduced, weights gathered for the sync."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "datasets", reason="datasets is not installed (a GPU host may lack the non-torch dependencies)"
)

import torch  # noqa: E402
from conftest import free_port  # noqa: E402
from test_trainer_e2e import restore_server, server_greedy  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

HERE = Path(__file__).parent


def torchrun(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(free_port()), str(HERE / script), *args]
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=timeout)


def test_fsdp2_loss_and_gradients_match_one_process():
    """Rank r trains on row r of a micro-batch; the summed loss and the reduced gradients equal one
    unsharded process training on both rows (the trainer's `row_loss`, score-centered loss)."""
    result = torchrun("fsdp_loss_worker.py", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("max grad diff") == 2


@pytest.mark.vllm
def test_two_processes_train_checkpoint_and_resume_against_the_server(vllm_server, tiny_model_dir, tmp_path):
    before = server_greedy(vllm_server.url)
    try:
        first = torchrun(
            "multi_process_train.py", vllm_server.url, str(tiny_model_dir), str(tmp_path), "2", timeout=600
        )
        after = server_greedy(vllm_server.url)
        assert first.returncode == 0, first.stderr[-5000:]
        checkpoint = tmp_path / "checkpoint-2"
        second = torchrun(
            "multi_process_train.py",
            vllm_server.url,
            str(tiny_model_dir),
            str(tmp_path),
            "4",
            str(checkpoint),
            timeout=600,
        )
        assert second.returncode == 0, second.stderr[-5000:]
    finally:
        restore_server(vllm_server.url, tiny_model_dir)
    steps = [entry for entry in json.loads((tmp_path / "history-2.json").read_text()) if "loss" in entry]
    assert [entry["step"] for entry in steps] == [1, 2]
    assert all(entry["batch/samples_per_step"] > 0 and entry["grad_norm"] > 0 for entry in steps)
    assert after != before, "the server must run the weights gathered from the sharded model"
    # The checkpoint holds the whole (gathered) model, loadable by a single process.
    saved = AutoModelForCausalLM.from_pretrained(checkpoint)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert all(p.shape == q.shape for p, q in zip(saved.parameters(), initial.parameters()))
    assert any(not torch.equal(p, q) for p, q in zip(saved.parameters(), initial.parameters()))
    optimizer_state = torch.load(checkpoint / "optimizer.pt", weights_only=False)
    assert len(optimizer_state["state"]) == len(list(initial.parameters()))  # every parameter's moments
    # Resuming continues the steps, the prompts and the policy version (and loads that optimizer state).
    resumed = [entry for entry in json.loads((tmp_path / "history-4.json").read_text()) if "loss" in entry]
    assert [entry["step"] for entry in resumed] == [1, 2, 3, 4]  # the restored history, then 3 and 4
    state_2 = json.loads((checkpoint / "rollout_state.json").read_text())
    state_4 = json.loads((tmp_path / "checkpoint-4" / "rollout_state.json").read_text())
    assert state_4["epoch_prompts"] > state_2["epoch_prompts"] > 0
    assert state_4["model_version"] > state_2["model_version"]
