"""Checkpoints that scale (docs/scaling.md, "Checkpoints"): written as every process's own shards while
training goes on, resumed on another number of processes with the same next steps, exported as a
Hugging Face folder that transformers and vLLM load, and the layout written before them still resumes.
The kills and full disks of a save, on both layouts, are in tests/unit/test_run_durability.py."""

from __future__ import annotations

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
from conftest import free_port, make_config  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_trainer_e2e import hf_greedy, restore_server, server_greedy  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback  # noqa: E402
from worker_side import prompts, token_parity_reward  # noqa: E402

from asyncgrpo.checkpoints.export import adapter_file_name, export_checkpoint  # noqa: E402
from asyncgrpo.checkpoints.hf_folder import INDEX_FILE, TensorSpec, file_names, plan_files  # noqa: E402
from asyncgrpo.checkpoints.layout import (  # noqa: E402
    MANIFEST_FILE,
    SHARDS_DIR,
    ShardedManifest,
    checkpoint_layout,
    choose_layout,
)
from asyncgrpo.checkpoints.sharded_state import (  # noqa: E402
    load_training_state,
    model_tensor_shapes,
    training_state,
)
from asyncgrpo.cli.main import main as cli_main  # noqa: E402

HERE = SUPPORT
ROOT = HERE.parents[1]
WORKER = HERE / "sharded_resume_worker.py"
# The commit whose code wrote every checkpoint before sharded ones existed (issue 58 starts from it).
BEFORE_SHARDED_CHECKPOINTS = "bfa9fbd"


def run_worker(mode: str, processes: int, model_dir: Path, checkpoint: Path, output: Path) -> dict:
    """tests/support/sharded_resume_worker.py on `processes` processes (torchrun and gloo for more than
    one)."""
    command = [sys.executable]
    if processes > 1:
        command += ["-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
        command += ["--master_port", str(free_port())]
    command += [str(WORKER), mode, str(model_dir), str(checkpoint), str(output)]
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    return json.loads(output.read_text())


@pytest.fixture(scope="module")
def two_process_run(tiny_model_dir, tmp_path_factory) -> tuple[dict, Path]:
    """Four steps on two processes, checkpointed after step 2 while steps 3 and 4 train."""
    folder = tmp_path_factory.mktemp("two-processes")
    losses = run_worker("train", 2, tiny_model_dir, folder / "checkpoint-2", folder / "train.json")
    return losses, folder / "checkpoint-2"


@pytest.mark.slow
def test_two_processes_save_one_resumes_and_the_reverse_with_the_next_steps_of_an_uninterrupted_run(
    two_process_run, tiny_model_dir, tmp_path
):
    """Written by two processes (FSDP2 shards), read by one; written by one, read by two: steps 3 and 4
    after the resume have the losses of the run that never stopped, so the weights and the optimizer's
    moments came back whole (a fresh optimizer would change step 4)."""
    uninterrupted, written_by_two = two_process_run
    assert uninterrupted["world_size"] == 2
    manifest = ShardedManifest.load(written_by_two)
    assert manifest.world_size == 2 and manifest.holds_optimizer and manifest.step == 2
    assert sorted(path.name for path in (written_by_two / SHARDS_DIR).iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ], "each process wrote its own shards"
    resumed_on_one = run_worker("resume", 1, tiny_model_dir, written_by_two, tmp_path / "resumed-1.json")
    assert resumed_on_one["losses"] == {step: uninterrupted["losses"][step] for step in ("3", "4")}

    written_by_one = tmp_path / "one" / "checkpoint-2"
    alone = run_worker("train", 1, tiny_model_dir, written_by_one, tmp_path / "train-1.json")
    assert ShardedManifest.load(written_by_one).world_size == 1
    resumed_on_two = run_worker("resume", 2, tiny_model_dir, written_by_one, tmp_path / "resumed-2.json")
    assert resumed_on_two["world_size"] == 2
    assert resumed_on_two["losses"] == {step: alone["losses"][step] for step in ("3", "4")}
    # One process and two compute the same steps here (the same batch on every rank): the runs agree.
    assert alone["losses"] == uninterrupted["losses"]


@pytest.mark.slow  # the checkpoint of two processes it exports
def test_an_export_is_a_folder_of_the_checkpoints_weights_that_transformers_loads(
    two_process_run, tiny_model_dir, tmp_path
):
    """`asyncgrpo export`: the weights of every rank's shards, consolidated, in safetensors files of at
    most the size asked for, with their index, the config and the tokenizer, none of the run's files."""
    _, checkpoint = two_process_run
    out = tmp_path / "exported"
    assert cli_main(["export", str(checkpoint), str(out), "--max-file-size", "1MB"]) == 0
    files = sorted(path.name for path in out.iterdir())
    weight_files = [name for name in files if name.endswith(".safetensors")]
    assert len(weight_files) > 1 and weight_files == file_names(len(weight_files)) and INDEX_FILE in files
    assert all((out / name).stat().st_size <= 2**20 + 2**16 for name in weight_files)  # a 1 MB plan each
    assert {"config.json", "tokenizer.json", "chat_template.jinja"} <= set(files)
    assert SHARDS_DIR not in files and MANIFEST_FILE not in files
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    read_back = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint))
    load_training_state(read_back, None, checkpoint, ShardedManifest.load(checkpoint), distributed=False)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert all(
        torch.equal(p, q) for p, q in zip(exported.state_dict().values(), read_back.state_dict().values())
    )
    assert any(not torch.equal(p, q) for p, q in zip(exported.parameters(), initial.parameters())), "trained"
    with pytest.raises(FileExistsError, match="not an empty directory"):
        export_checkpoint(checkpoint, out)


def test_plan_and_names_of_the_weight_files():
    specs = [TensorSpec(f"w{i}", (256, 256), torch.float32) for i in range(5)]  # 256 KiB each
    assert [[s.name for s in file] for file in plan_files(specs, 600 * 1024)] == [
        ["w0", "w1"],
        ["w2", "w3"],
        ["w4"],
    ]
    assert [len(file) for file in plan_files(specs, 100)] == [1] * 5, "a larger tensor: a file of its own"
    assert file_names(1) == ["model.safetensors"]
    assert file_names(2) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert adapter_file_name("base_model.model.model.layers.0.q_proj.lora_A.default.weight", "default") == (
        "base_model.model.model.layers.0.q_proj.lora_A.weight"
    )


def test_the_layout_of_a_directory_and_the_layout_a_run_writes(tmp_path):
    assert choose_layout("auto", 1) == "full" and choose_layout("auto", 8) == "sharded"
    assert choose_layout("full", 8) == "full" and choose_layout("sharded", 1) == "sharded"
    assert checkpoint_layout(tmp_path) == "full"
    (tmp_path / SHARDS_DIR).mkdir()
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        checkpoint_layout(tmp_path)
    ShardedManifest(step=3, world_size=2, holds_optimizer=True, dtype="float32").save(tmp_path)
    assert checkpoint_layout(tmp_path) == "sharded"
    fields = json.loads((tmp_path / MANIFEST_FILE).read_text()) | {"version": 99}
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(fields))
    with pytest.raises(ValueError, match="upgrade asyncgrpo"):
        ShardedManifest.load(tmp_path)


# -- the trainer: the layout it writes, what a sharded checkpoint holds, and what resumes -----------------


def sharded_config(server, output_dir, **overrides):
    options = dict(
        max_steps=3, save_strategy="steps", save_steps=1, save_total_limit=2, checkpoint_format="sharded",
        learning_rate=1e-3,
    )  # fmt: skip
    return make_config(server, output_dir, **(options | overrides))


class StartingPoint(TrainerCallback):
    """The weights and optimizer moments a run starts training from."""

    def __init__(self):
        self.trainer = None
        self.weights: dict[str, torch.Tensor] = {}
        self.moments: dict[int, torch.Tensor] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.weights = {name: p.detach().clone() for name, p in self.trainer.model.named_parameters()}
        self.moments = first_moments(self.trainer)


def first_moments(trainer) -> dict[int, torch.Tensor]:
    """Adam's first moments by the parameter's index in the optimizer (optimizer.pt's keys)."""
    return {
        index: state["exp_avg"].clone() for index, state in trainer.optimizer.state_dict()["state"].items()
    }


@pytest.mark.vllm
def test_a_run_writes_sharded_checkpoints_while_it_trains_and_resumes_from_the_last(
    vllm_server, tiny_model_dir, tmp_path
):
    """One process with checkpoint_format="sharded": checkpoints written in the background, rotated by
    save_total_limit once the new one is complete; `resume_from_checkpoint=True` reads the last one's
    shards (weights and moments), schedule, step, prompt position and held samples; the report reads
    the run; an export of the last checkpoint is what the server then serves."""
    from asyncgrpo import AsyncGRPOTrainer
    from asyncgrpo.trainer.checkpoint import read_resume_point

    try:
        first = AsyncGRPOTrainer(
            str(tiny_model_dir),
            token_parity_reward,
            sharded_config(vllm_server, tmp_path),
            train_dataset=prompts(),
        )
        first.train()
        assert sorted(path.name for path in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
        last = tmp_path / "checkpoint-3"
        assert checkpoint_layout(last) == "sharded" and not list(tmp_path.glob(".checkpoint-*"))
        assert ShardedManifest.load(last).world_size == 1
        position = read_resume_point(str(last), streaming=False).rollout
        assert position.model_version == 3 and position.epoch_prompts > 0
        assert any("perf/checkpoint_stall_s" in entry for entry in first.state.log_history)
        trained = {name: p.detach().clone() for name, p in first.model.named_parameters()}
        moments = first_moments(first)

        starting = StartingPoint()
        resumed = AsyncGRPOTrainer(
            str(tiny_model_dir),
            token_parity_reward,
            sharded_config(vllm_server, tmp_path, max_steps=4),
            train_dataset=prompts(),
            callbacks=[starting],
        )
        starting.trainer = resumed
        resumed.train(resume_from_checkpoint=True)
        assert resumed.state.global_step == 4
        assert all(torch.equal(starting.weights[name], trained[name]) for name in trained)
        assert starting.moments.keys() == moments.keys() and len(moments) > 0
        assert all(torch.equal(starting.moments[index], moments[index]) for index in moments)
        later = read_resume_point(str(tmp_path / "checkpoint-4"), streaming=False).rollout
        assert later.model_version == 4 and later.epoch_prompts > position.epoch_prompts
        assert cli_main(["report", str(tmp_path)]) == 0

        out = tmp_path / "served"
        assert cli_main(["export", str(tmp_path / "checkpoint-4"), str(out)]) == 0
        exported_files = {path.name for path in out.iterdir()}
        assert {
            "model.safetensors",
            "config.json",
            "generation_config.json",
            "tokenizer.json",
        } <= exported_files
        run_files = {
            "trainer_state.json",
            "rollout_state.json",
            "scheduler.pt",
            "rng_state.pth",
            MANIFEST_FILE,
        }
        assert run_files <= {path.name for path in (tmp_path / "checkpoint-4").iterdir()}
        assert not run_files & exported_files, "the run's own files stay in the checkpoint"
        exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert all(
            torch.equal(p, resumed.model.state_dict()[name]) for name, p in exported.state_dict().items()
        )
        reload_weights(vllm_server.url, out)
        assert server_greedy(vllm_server.url) == hf_greedy(exported)
    finally:
        restore_server(vllm_server.url, tiny_model_dir)


def reload_weights(url: str, folder: Path) -> None:
    import asyncio

    from asyncgrpo.generation.client import VLLMClient, policy_label

    async def run():
        async with VLLMClient(url, timeout=60) as client:
            await client.reload_weights(str(folder), version=policy_label(99))
            await client.reset_prefix_cache()

    asyncio.run(run())


OLD_LAYOUT_WRITER = """
import sys
import torch
from datasets import Dataset
from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.rollout.prompts import PromptOrder
from asyncgrpo.trainer.checkpoint import ResumePoint, save_checkpoint
from asyncgrpo.trainer.distributed import Processes
from asyncgrpo.trainer.prompt_ledger import RolloutState

model_dir, output_dir = sys.argv[1:3]
args = AsyncGRPOConfig(output_dir=output_dir, report_to="none", max_steps=10, seed=0, learning_rate=1e-3)
rows = Dataset.from_dict({"prompt": [[{"role": "user", "content": "q"}]]})
no_reward = lambda completions, **kw: [0.0] * len(completions)
trainer = AsyncGRPOTrainer(model_dir, no_reward, args, train_dataset=rows)
trainer.create_optimizer_and_scheduler(num_training_steps=10)
batch = torch.arange(24).view(1, 24)
trainer.model(input_ids=batch, labels=batch).loss.backward()
trainer.optimizer.step()
trainer.lr_scheduler.step()
trainer.state.global_step = 2
order = PromptOrder.of(args)
position = RolloutState(first_untrained_index=6, epoch_prompts=6, model_version=2, prompt_order=order)
save_checkpoint(trainer, trainer.model, None, ResumePoint(position), Processes(1, 0), sharded=False)
"""


@pytest.mark.vllm
def test_a_checkpoint_written_before_sharded_checkpoints_existed_still_resumes(
    vllm_server, tiny_model_dir, tmp_path
):
    """A checkpoint written by the code of bfa9fbd (taken from the repository's history, a Hugging Face
    folder with optimizer.pt) resumes: its weights, moments, step and prompt position."""
    from asyncgrpo import AsyncGRPOTrainer
    from asyncgrpo.trainer.checkpoint import read_resume_point

    old_code = tmp_path / "old-code"
    old_code.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", BEFORE_SHARDED_CHECKPOINTS, "asyncgrpo"], capture_output=True
    )
    assert archive.returncode == 0, (
        f"this test reads the code of {BEFORE_SHARDED_CHECKPOINTS} from the repository's history (run it in "
        f"a git clone): {archive.stderr.decode()}"
    )
    subprocess.run(["tar", "-x", "-C", str(old_code)], input=archive.stdout, check=True)
    run = tmp_path / "run"
    environment = {**os.environ, "PYTHONPATH": str(old_code), "CUDA_VISIBLE_DEVICES": ""}
    written = subprocess.run(
        [sys.executable, "-c", OLD_LAYOUT_WRITER, str(tiny_model_dir), str(run)],
        env=environment, capture_output=True, text=True, timeout=300, cwd=tmp_path,  # not this tree's code
    )  # fmt: skip
    assert written.returncode == 0, written.stderr[-3000:]
    checkpoint = run / "checkpoint-2"
    assert checkpoint_layout(checkpoint) == "full" and (checkpoint / "optimizer.pt").exists()
    saved_weights = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).state_dict()
    saved_moments = torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"]

    starting = StartingPoint()
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir),
        token_parity_reward,
        make_config(vllm_server, run, max_steps=3, save_strategy="steps", save_steps=1, learning_rate=1e-3),
        train_dataset=prompts(),
        callbacks=[starting],
    )
    starting.trainer = trainer
    try:
        trainer.train(resume_from_checkpoint=True)
    finally:
        restore_server(vllm_server.url, tiny_model_dir)
    assert trainer.state.global_step == 3
    assert all(torch.equal(starting.weights[name], saved_weights[name]) for name in starting.weights)
    assert starting.moments.keys() == saved_moments.keys() and len(saved_moments) > 0
    assert all(
        torch.equal(starting.moments[index], saved_moments[index]["exp_avg"]) for index in saved_moments
    )
    assert read_resume_point(str(run / "checkpoint-3"), streaming=False).rollout.model_version == 3
    # One process keeps the full layout by default ("auto"): a folder from_pretrained loads.
    assert checkpoint_layout(run / "checkpoint-3") == "full"


def test_a_sharded_checkpoint_of_save_only_model_holds_no_optimizer(tiny_model_dir, tmp_path):
    """save_only_model: the shards hold the model alone; a resume then starts a fresh optimizer. (Written
    with checkpoint_async=False: the save is whole when `save` returns.)"""
    from datasets import Dataset

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.records.metrics import MetricsWindow
    from asyncgrpo.trainer.checkpoint import ResumePoint
    from asyncgrpo.trainer.checkpoint_saves import RunCheckpoints
    from asyncgrpo.trainer.distributed import Processes

    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", max_steps=4, save_only_model=True)
    rows = Dataset.from_dict({"prompt": [[{"role": "user", "content": "q"}]]})
    trainer = AsyncGRPOTrainer(str(tiny_model_dir), token_parity_reward, args, train_dataset=rows)
    try:
        trainer.create_optimizer_and_scheduler(num_training_steps=4)
        checkpoints = RunCheckpoints(Processes(1, 0), "sharded", False, False, MetricsWindow(), lock=None)
        trainer.state.global_step = 1
        checkpoints.save(trainer, trainer.model, None, ResumePoint())
        assert (tmp_path / "checkpoint-1").is_dir(), "durable when save returns"
    finally:
        trainer.callback_handler.on_train_end(args, trainer.state, trainer.control)
    checkpoint = tmp_path / "checkpoint-1"
    assert not ShardedManifest.load(checkpoint).holds_optimizer
    assert not (checkpoint / "scheduler.pt").exists()
    assert set(model_tensor_shapes(checkpoint)) == set(trainer.model.state_dict())
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint))
    optimizer = torch.optim.AdamW(model.parameters())
    assert not load_training_state(model, optimizer, checkpoint, ShardedManifest.load(checkpoint), False)
    weights = load_file(next((tiny_model_dir).glob("*.safetensors")))
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in weights.items())


def test_a_peft_runs_sharded_checkpoint_holds_the_adapter_and_exports_as_one(tiny_model_dir, tmp_path):
    """A PEFT run's shards hold the adapter and its moments alone (the frozen base comes from the model
    again); read back into a fresh adapter they are the trained ones, and the export is an adapter folder
    PeftModel loads, with the adapter's config."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from asyncgrpo.checkpoints.background import ShardedWriter
    from asyncgrpo.trainer.checkpoint_saves import publish_sharded
    from asyncgrpo.trainer.distributed import Processes

    def adapted():
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))

    torch.manual_seed(0)
    model = adapted()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = torch.arange(24).view(1, 24)
    for _ in range(2):
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    checkpoint = tmp_path / "checkpoint-2"
    staging = tmp_path / ".checkpoint-2.partial"
    staging.mkdir()
    model.peft_config["default"].save_pretrained(staging)
    manifest = ShardedManifest(
        step=2, world_size=1, holds_optimizer=True, dtype="float32", peft_adapter="default"
    )
    writer = ShardedWriter(Processes(1, 0), asynchronous=True)
    state = training_state(model, optimizer, trainable_only=True)
    writer.start(
        2, state, staging / SHARDS_DIR, lambda: publish_sharded(staging, checkpoint, manifest, *[None] * 4)
    )
    assert writer.settle(wait=True).error is None
    trained = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    assert set(model_tensor_shapes(checkpoint)) == set(trained), "the adapter alone"

    fresh = adapted()
    fresh_optimizer = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    assert load_training_state(fresh, fresh_optimizer, checkpoint, ShardedManifest.load(checkpoint), False)
    assert all(torch.equal(p, trained[name]) for name, p in fresh.named_parameters() if p.requires_grad)
    moments = [fresh_optimizer.state[p]["exp_avg"] for p in fresh.parameters() if p.requires_grad]
    assert all(
        torch.equal(a, optimizer.state[p]["exp_avg"])
        for a, p in zip(moments, optimizer.param_groups[0]["params"])
    )

    out = tmp_path / "adapter"
    export_checkpoint(checkpoint, out)
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {path.name for path in out.iterdir()}
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out)
    assert all(torch.equal(p, trained[name]) for name, p in loaded.named_parameters() if name in trained)
    assert len([name for name, _ in loaded.named_parameters() if "lora_" in name]) == len(trained)


def test_load_best_model_at_end_reads_a_sharded_best_checkpoint(tiny_model_dir, tmp_path):
    from datasets import Dataset

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.records.metrics import MetricsWindow
    from asyncgrpo.trainer.checkpoint import ResumePoint
    from asyncgrpo.trainer.checkpoint_saves import RunCheckpoints
    from asyncgrpo.trainer.distributed import Processes

    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", max_steps=4)
    rows = Dataset.from_dict({"prompt": [[{"role": "user", "content": "q"}]]})
    trainer = AsyncGRPOTrainer(str(tiny_model_dir), token_parity_reward, args, train_dataset=rows)
    try:
        trainer.create_optimizer_and_scheduler(num_training_steps=4)
        checkpoints = RunCheckpoints(Processes(1, 0), "sharded", True, False, MetricsWindow(), lock=None)
        trainer.state.global_step = 2
        checkpoints.save(trainer, trainer.model, None, ResumePoint())
        checkpoints.close()  # the save in flight lands, as at the end of a run
        best = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        with torch.no_grad():
            for parameter in trainer.model.parameters():
                parameter.add_(1.0)  # the training after the best checkpoint
        trainer.state.best_model_checkpoint = str(tmp_path / "checkpoint-2")
        trainer._load_best_model()
    finally:
        trainer.callback_handler.on_train_end(args, trainer.state, trainer.control)
    assert all(torch.equal(p, best[name]) for name, p in trainer.model.named_parameters())


def test_a_settled_background_save_leaves_no_writer_thread_behind(tiny_model_dir, tmp_path, monkeypatch):
    """A writer thread still alive at the interpreter's exit is stopped inside torch's C++ code and
    aborts a process whose save succeeded: once `settle` reports the outcome the thread has ended, even
    when its last lines after the outcome (the timeline's record) are slow."""
    import threading
    import time

    from asyncgrpo.checkpoints import background
    from asyncgrpo.checkpoints.background import ShardedWriter
    from asyncgrpo.trainer.distributed import Processes

    def slow_record(*args, **kwargs):
        time.sleep(0.5)

    monkeypatch.setattr(background.timeline, "interval", slow_record)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters())
    writer = ShardedWriter(Processes(1, 0), asynchronous=True)
    writer.start(1, training_state(model, optimizer, trainable_only=False), tmp_path / SHARDS_DIR, None)
    writer.wait_for_copy()
    assert writer.settle(wait=True).error is None
    assert not [thread for thread in threading.enumerate() if thread.name == "checkpoint-writer"]
    writer.close()
