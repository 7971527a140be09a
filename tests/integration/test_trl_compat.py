"""TRL 1.16 scripts run unchanged: its config fields, its FSDP2 launch, its example script, its public
trainer attributes and the Trainer callbacks its loop calls."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support_paths import SUPPORT

pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

import torch  # noqa: E402
from aiohttp import web  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from asyncgrpo.generation.client import SamplingParams, VLLMClient, VLLMUnavailableError  # noqa: E402
from asyncgrpo.trainer.epoch_callbacks import EpochCallbacks  # noqa: E402
from asyncgrpo.trainer.fsdp_launch import read_fsdp_launch  # noqa: E402

HERE = SUPPORT

# Every field TRL 1.16's AsyncGRPOConfig declares itself, at TRL's defaults.
TRL_116_FIELDS = dict(  # noqa: C408 (keyword form: the fields read as a config call)
    model_init_kwargs=None, dtype="float32", trust_remote_code=False, router_aux_loss_coef=None,
    learning_rate=1e-6, logging_steps=1, lr_scheduler_type="constant", ignore_data_skip=True,
    num_generations=8, max_completion_length=2048, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
    repetition_penalty=1.0, chat_template_kwargs=None, max_tool_calling_iterations=None,
    fork_threshold_tokens=1024,
    vllm_server_base_url="http://localhost:8000", vllm_server_timeout=240.0, request_timeout=600,
    weight_sync_timeout=1800, epsilon=0.2, epsilon_high=None, token_budget=None, max_inflight_tasks=-1,
    max_staleness=4, queue_maxsize=1024, weight_sync_steps=1, heartbeat_stale_after_s=300.0,
    log_completions=False, num_completions_to_print=None,
)  # fmt: skip


def test_every_trl_116_config_field_is_accepted(tmp_path):
    config = AsyncGRPOConfig(str(tmp_path), report_to="none", **TRL_116_FIELDS)
    assert (config.request_timeout, config.weight_sync_timeout, config.vllm_server_timeout) == (
        600,
        1800,
        240.0,
    )
    assert config.max_concurrent_rollouts == 512  # -1: auto, ours stays in charge
    # Left unset, both timeouts are the server timeout (one bound for every wait, as before).
    config = AsyncGRPOConfig(str(tmp_path), report_to="none", vllm_server_timeout=42.0)
    assert (config.request_timeout, config.weight_sync_timeout) == (42.0, 42.0)


def test_trl_names_map_onto_ours_and_conflicts_are_refused(tmp_path):
    config = AsyncGRPOConfig(
        str(tmp_path), report_to="none", max_inflight_tasks=64, heartbeat_stale_after_s=30.0
    )
    assert (config.max_concurrent_rollouts, config.rollout_worker_timeout) == (64, 30.0)
    with pytest.raises(ValueError, match="give only one of them"):
        AsyncGRPOConfig(str(tmp_path), report_to="none", max_inflight_tasks=64, max_concurrent_rollouts=32)
    with pytest.raises(ValueError, match="give only one of them"):
        AsyncGRPOConfig(
            str(tmp_path), report_to="none", heartbeat_stale_after_s=30.0, rollout_worker_timeout=60.0
        )
    with pytest.raises(ValueError, match="max_inflight_tasks=0"):
        AsyncGRPOConfig(str(tmp_path), report_to="none", max_inflight_tasks=0)
    with pytest.raises(ValueError, match="request_timeout=0"):
        AsyncGRPOConfig(str(tmp_path), report_to="none", request_timeout=0)
    with pytest.raises(ValueError, match="repetition_penalty"):
        AsyncGRPOConfig(str(tmp_path), report_to="none", repetition_penalty=0.0)


def test_fields_without_effect_warn_once_saying_why(tmp_path, caplog, monkeypatch):
    from asyncgrpo.config import trl_compat

    monkeypatch.setattr(trl_compat, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.config.trl_compat"):
        for _ in range(2):
            AsyncGRPOConfig(str(tmp_path), report_to="none", queue_maxsize=64, fork_threshold_tokens=8)
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2, messages
    assert "queue_maxsize=64 has no effect" in messages[0] and "max_staleness" in messages[0]
    assert "fork_threshold_tokens=8 has no effect" in messages[1]


def test_token_budget_zero_or_below_is_trls_fixed_count_mode(tmp_path):
    for budget in (0, -1):
        config = AsyncGRPOConfig(
            str(tmp_path), report_to="none", token_budget=budget, per_device_train_batch_size=4
        )
        assert (config.token_budget, config.per_device_train_batch_size) == (budget, 4)
    for budget in (1, 15):
        with pytest.raises(ValueError, match=rf"token_budget={budget} is too small.*or <= 0"):
            AsyncGRPOConfig(str(tmp_path), report_to="none", token_budget=budget)
    with pytest.raises(ValueError, match="per_device_train_batch_size=0 must be >= 1"):
        AsyncGRPOConfig(str(tmp_path), report_to="none", token_budget=0, per_device_train_batch_size=0)


def test_fixed_count_intake_plans_full_rows_and_lets_the_worker_start():
    """With token_budget <= 0 the worker's first allowance assumes rows of samples of max_model_len (a
    zero budget must not hold generation back), and a step is micro-batches of rows of exactly
    per_device_train_batch_size samples, however long."""
    from test_prompt_ledger import QueueDouble, group, sample

    from asyncgrpo.records.metrics import MetricsWindow
    from asyncgrpo.trainer.intake import SampleIntake
    from asyncgrpo.trainer.prompt_ledger import PromptLedger

    queue = QueueDouble([group(index, [sample(index, length=400) for _ in range(4)]) for index in range(4)])
    intake = SampleIntake(
        queue, PromptLedger(), 1, token_budget=0, num_rows=2, rows_per_step=4, samples_per_row=3,
        max_sample_tokens=256,
    )  # fmt: skip
    assert queue.allowance == 3 * 256 * 4
    batch = intake.next_step(gradient_accumulation_steps=2, metrics=MetricsWindow(), model_version=0)
    assert [[len(row) for row in plan.rows] for plan in batch.plans] == [[3, 3], [3, 3]]
    assert len(intake.buffer) == 16 - 12  # the rest waits for the next step


def test_request_timeout_bounds_generation_requests_not_the_other_calls():
    async def never(request: web.Request) -> web.Response:
        await asyncio.sleep(3600)
        return web.Response()

    async def scenario():
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", never)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            client = VLLMClient(
                url, timeout=30.0, model="m", generation_timeout_retries=0, request_timeout=0.5
            )
            async with client:
                started = time.monotonic()
                with pytest.raises(VLLMUnavailableError, match="within 0 s|within 1 s"):
                    await client.complete([1, 2], SamplingParams(max_tokens=2), seed=0)
                generation_s = time.monotonic() - started
                started = time.monotonic()
                # weight_sync_timeout reaches the sync's calls: the server is skipped within it
                assert await client.pause(timeout=0.5) == [url]
                return generation_s, time.monotonic() - started
        finally:
            await runner.cleanup()

    generation_s, pause_s = asyncio.run(scenario())
    assert generation_s < 3.0 and pause_s < 3.0


def test_trl_fsdp2_config_is_read_not_refused():
    from accelerate.utils import FullyShardedDataParallelPlugin

    # TRL's fsdp2.yaml, as accelerate turns it into a plugin (sync_module_states needs a GPU: off here).
    common = {
        "fsdp_version": 2,
        "auto_wrap_policy": "transformer_based_wrap",
        "cpu_ram_efficient_loading": False,
    }
    launch = read_fsdp_launch(
        FullyShardedDataParallelPlugin(
            reshard_after_forward=True, state_dict_type="FULL_STATE_DICT", **common
        )
    )
    # The state dict type is accelerate's way to save FSDP checkpoints; checkpoint_format is this trainer's.
    assert launch.reshard_after_forward is True and launch.notes == [
        "fsdp_state_dict_type (FULL_STATE_DICT) is not read: checkpoint_format says how checkpoints are "
        "written (by default sharded, each process writing its own shards)"
    ]
    launch = read_fsdp_launch(
        FullyShardedDataParallelPlugin(
            reshard_after_forward=False, state_dict_type="SHARDED_STATE_DICT", **common
        )
    )
    assert launch.reshard_after_forward is False and "(SHARDED_STATE_DICT) is not read" in launch.notes[0]
    with pytest.raises(ValueError, match="fsdp_offload_params"):
        read_fsdp_launch(FullyShardedDataParallelPlugin(cpu_offload=True, **common))
    assert read_fsdp_launch(None) is None


class Recorder(TrainerCallback):
    def __init__(self):
        self.events: list[str] = []
        self.trainer = None
        self.seen: dict = {}

    def __getattribute__(self, name):
        if name.startswith("on_") and name != "on_init_end":
            events = object.__getattribute__(self, "events")
            return lambda *args, **kwargs: events.append(name)
        return object.__getattribute__(self, name)


def test_epoch_callbacks_bracket_passes_over_the_prompts():
    from transformers import TrainerControl, TrainerState
    from transformers.trainer_callback import CallbackHandler

    recorder = Recorder()
    handler = CallbackHandler([recorder], None, None, None, None)
    epochs, state, control = EpochCallbacks(handler), TrainerState(epoch=0.0), TrainerControl()
    for epoch in (0.4, 0.9, 1.3, 1.8, 2.0, 2.2):  # state.epoch after each step
        epochs.before_step(None, state, control)
        state.epoch = epoch
        epochs.after_step(None, state, control)
    epochs.finish(None, state, control)
    # Epoch 0 ends with the step reaching 1.3, epoch 1 with the one reaching 2.0, epoch 2 when training ends.
    assert recorder.events == ["on_epoch_begin", "on_epoch_end"] * 3


# -- against a real vLLM server ---------------------------------------------------------------------------


def boxed_answer_model(out_dir: Path) -> Path:
    """The tiny model after a few supervised steps that make it answer `\\boxed{1}` or `\\boxed{2}`,
    about half of the time each, then stop: rewards differ within a group, so GRPO has a signal."""
    from asyncgrpo.cli.tiny_model import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = build_model(tokenizer)
    rng = random.Random(0)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 1 + 0?"}], add_generation_prompt=True, tokenize=True
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    answers = [tokenizer.encode(f"\\boxed{{{n}}}") + [tokenizer.eos_token_id] for n in (1, 2)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(40):
        batch = [prompt + rng.choice(answers) for _ in range(16)]
        length = max(map(len, batch))
        ids = torch.full((len(batch), length), tokenizer.pad_token_id)
        labels = torch.full((len(batch), length), -100)
        for row, sequence in enumerate(batch):
            ids[row, : len(sequence)] = torch.tensor(sequence)
            labels[row, len(prompt) : len(sequence)] = torch.tensor(sequence[len(prompt) :])
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def gsm8k_shaped(path: Path, n: int = 16) -> Path:
    rows = [{"question": "What is 1 + 0?", "answer": "One plus zero is one.\n#### 1"} for _ in range(n)]
    path.write_text("\n".join(json.dumps(row) for row in rows))
    return path


@pytest.mark.vllm
def test_trl_example_script_runs_with_only_the_import_changed(vllm_server, tiny_model_dir, tmp_path):
    """TRL 1.16's async GRPO example (tests/support/trl_example/async_grpo.py says what differs), launched the
    way TRL documents it: `accelerate launch --config_file fsdp2.yaml` with TRL's own config."""
    from test_trainer_e2e import restore_server

    model_dir = boxed_answer_model(tmp_path / "model")
    data = gsm8k_shaped(tmp_path / "gsm8k.jsonl")
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(HERE / "trl_example" / "fsdp2.yaml"), "--num_processes", "1",
        str(HERE / "trl_example" / "async_grpo.py"), str(model_dir), str(data), vllm_server.url,
    ]  # fmt: skip
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parents[1])}
    launch = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a timeout stops the launcher and the training process it started
    )
    try:
        stdout, stderr = launch.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(launch.pid, signal.SIGKILL)
        stdout, stderr = launch.communicate()
    finally:
        restore_server(vllm_server.url, tiny_model_dir)
    result = subprocess.CompletedProcess(command, launch.returncode, stdout, stderr)
    assert result.returncode == 0, result.stderr[-5000:]
    output = result.stdout + result.stderr
    # The progress line of the last of its 3 steps. Its fields are the window's metrics: `reward` only
    # when a group was scored since the last log, which a loaded machine can skip (seen in a full run).
    assert re.search(r"^step 3  \w+=", output, re.MULTILINE), output[-3000:]


@pytest.mark.vllm
def test_trl_attributes_and_trainer_callbacks_during_training(vllm_server, tiny_model_dir, tmp_path):
    from conftest import make_config
    from test_trainer_e2e import prompts, restore_server, token_parity_reward

    recorder = Recorder()
    config = make_config(
        vllm_server, tmp_path, max_steps=2, gradient_accumulation_steps=2, token_budget=64,
        repetition_penalty=1.3, request_timeout=60, weight_sync_timeout=60,
    )  # fmt: skip
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir), token_parity_reward, config, train_dataset=prompts(), callbacks=[recorder]
    )
    assert trainer.vllm_client is None and trainer.model_version == 0 and trainer.rollout_worker is None

    class Attributes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            recorder.seen[state.global_step] = (
                trainer.model_version, trainer.vllm_client.base_urls, trainer.rollout_worker is not None,
                trainer.weight_transfer.name, trainer.weight_transfer.timeout_s,
            )  # fmt: skip

    trainer.add_callback(Attributes())
    try:
        trainer.train()
    finally:
        restore_server(vllm_server.url, tiny_model_dir)
    assert recorder.seen[1] == (1, [vllm_server.url], True, "filesystem", 60)
    assert recorder.seen[2][0] == 2
    per_step = [
        "on_step_begin",
        "on_substep_end",
        "on_pre_optimizer_step",
        "on_optimizer_step",
        "on_step_end",
    ]
    events = [event for event in recorder.events if event not in ("on_log", "on_save", "on_evaluate")]
    assert events == [
        "on_train_begin",
        "on_epoch_begin",
        *per_step,
        *per_step,
        "on_epoch_end",
        "on_train_end",
    ]


@pytest.mark.vllm
def test_fixed_count_rows_train_against_the_server(vllm_server, tiny_model_dir, tmp_path, monkeypatch):
    """token_budget=0 (TRL's fixed-count mode): every row holds per_device_train_batch_size samples,
    and row_fill_frac, which divides by the budget, is not logged. The same short run checks two
    TrainingArguments settings of the base Trainer's loop: torch_empty_cache_steps and
    include_num_input_tokens_seen."""
    from conftest import make_config
    from test_trainer_e2e import prompts, restore_server, token_parity_reward

    from asyncgrpo.trainer import base_loop_settings

    cleared = []
    monkeypatch.setattr(base_loop_settings, "clear_device_cache", lambda: cleared.append(True))
    config = make_config(
        vllm_server, tmp_path, max_steps=3, token_budget=0, per_device_train_batch_size=3,
        gradient_accumulation_steps=2, torch_empty_cache_steps=2, include_num_input_tokens_seen="non_padding",
    )  # fmt: skip
    trainer = AsyncGRPOTrainer(str(tiny_model_dir), token_parity_reward, config, train_dataset=prompts())
    try:
        trainer.train()
    finally:
        restore_server(vllm_server.url, tiny_model_dir)
    steps = [entry for entry in trainer.state.log_history if "batch/samples_per_step" in entry]
    assert len(steps) == 3
    for entry in steps:
        assert (entry["batch/samples_per_row"], entry["batch/samples_per_step"]) == (3, 6)
        assert entry["batch/microbatches_per_step"] == 2
        assert "batch/row_fill_frac" not in entry and "batch/row_imbalance" in entry
        assert entry["num_input_tokens_seen"] == entry["num_tokens"] > 0  # forwarded tokens, cumulative
    assert len(cleared) == 1  # after step 2
