"""Several training processes on CPU (torchrun, gloo): FSDP2 sharding applied by the trainer, one
row per process, gradients reduced, weights gathered for the sync."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import free_port
from test_trainer_e2e import restore_server, server_greedy

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
def test_two_processes_train_against_the_server(vllm_server, tiny_model_dir, tmp_path):
    before = server_greedy(vllm_server.url)
    try:
        result = torchrun("multi_process_train.py", vllm_server.url, str(tiny_model_dir), str(tmp_path), timeout=600)
        after = server_greedy(vllm_server.url)
    finally:
        restore_server(vllm_server.url, tiny_model_dir)
    assert result.returncode == 0, result.stderr[-5000:]
    history = json.loads((tmp_path / "history.json").read_text())
    steps = [entry for entry in history if "loss" in entry]
    assert len(steps) == 3
    assert all(entry["batch/samples_per_step"] > 0 for entry in steps)
    assert all("grad_norm" in entry and entry["grad_norm"] > 0 for entry in steps)
    assert after != before, "the server must run the weights gathered from the sharded model"
