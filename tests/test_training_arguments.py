"""TrainingArguments fields that only the base Trainer's data loader or loop would read: each is honoured
here (data_seed, train_sampling_strategy, per_device_train_batch_size with token_budget <= 0,
torch_empty_cache_steps, include_num_input_tokens_seen) or warns once that it has no effect."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncgrpo import AsyncGRPOConfig, trl_compat
from asyncgrpo.rollout.prompts import PromptOrder, prompt_stream
from asyncgrpo.trainer import base_loop_settings
from asyncgrpo.trainer.base_loop_settings import EmptyDeviceCache, input_tokens_seen
from asyncgrpo.trainer.prompt_ledger import RolloutState


def config(tmp_path, **fields) -> AsyncGRPOConfig:
    return AsyncGRPOConfig(str(tmp_path), report_to="none", **fields)


def row_order(order: PromptOrder, num_rows: int = 12, count: int = 24) -> list[int]:
    stream = prompt_stream([{"prompt": str(i)} for i in range(num_rows)], order.seed)
    return [next(stream).row_index for _ in range(count)]


@pytest.fixture
def warnings_once(monkeypatch, caplog):
    """The warnings of the config's TRL-compatibility checks, each process warning once per field."""
    monkeypatch.setattr(trl_compat, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.trl_compat"):
        yield lambda: [record.getMessage() for record in caplog.records]


def test_settings_without_effect_warn_once_saying_why(tmp_path, warnings_once):
    for _ in range(2):
        config(
            tmp_path,
            per_device_train_batch_size=16,
            train_sampling_strategy="group_by_length",
            save_on_each_node=True,
        )
    messages = warnings_once()
    assert len(messages) == 3, messages
    per_device, sampling, save = messages
    assert "per_device_train_batch_size=16 has no effect with token_budget=None" in per_device
    assert "only when token_budget <= 0" in per_device
    assert "train_sampling_strategy='group_by_length' has no effect" in sampling and "shuffled" in sampling
    assert "save_on_each_node=True has no effect" in save and "rank 0" in save


def test_honoured_settings_and_defaults_do_not_warn(tmp_path, warnings_once):
    config(tmp_path)
    config(tmp_path, token_budget=0, per_device_train_batch_size=16)  # sets the samples per row
    config(tmp_path, train_sampling_strategy="sequential", data_seed=3)
    config(tmp_path, torch_empty_cache_steps=2, include_num_input_tokens_seen="non_padding")
    assert warnings_once() == []


def test_per_device_train_batch_size_with_a_budget_warns(tmp_path, warnings_once):
    config(tmp_path, token_budget=512, per_device_train_batch_size=4)
    assert ["token_budget=512" in message for message in warnings_once()] == [True]


# -- the prompt order ------------------------------------------------------------------------------------


def test_data_seed_orders_the_prompts_and_defaults_to_seed(tmp_path):
    seeded = PromptOrder.of(config(tmp_path, seed=1, data_seed=7))
    assert seeded == PromptOrder(7)
    assert row_order(seeded) == row_order(PromptOrder.of(config(tmp_path, seed=7)))
    assert row_order(seeded) == row_order(PromptOrder.of(config(tmp_path, seed=2, data_seed=7)))
    assert row_order(seeded) != row_order(PromptOrder.of(config(tmp_path, seed=1, data_seed=8)))
    assert PromptOrder.of(config(tmp_path, seed=5)) == PromptOrder(5)  # unset: `seed`, as transformers


def test_sequential_keeps_the_dataset_order_every_epoch(tmp_path):
    order = PromptOrder.of(config(tmp_path, train_sampling_strategy="sequential", data_seed=7))
    assert order == PromptOrder(None)
    assert row_order(order, num_rows=5, count=15) == list(range(5)) * 3
    shuffled = row_order(PromptOrder.of(config(tmp_path, train_sampling_strategy="random")), 5, 15)
    assert shuffled != list(range(5)) * 3 and sorted(shuffled[:5]) == list(range(5))


def test_a_seeded_order_resumes_where_it_stopped(tmp_path):
    order = PromptOrder.of(config(tmp_path, data_seed=11))
    rows = [{"prompt": str(i)} for i in range(10)]
    full = prompt_stream(rows, order.seed)
    expected = [next(full).row_index for _ in range(25)][13:]
    resumed = prompt_stream(rows, order.seed, start_index=13)
    assert [next(resumed).row_index for _ in range(12)] == expected


def test_the_checkpoint_records_its_order_and_refuses_another(tmp_path):
    RolloutState(first_untrained_index=4, prompt_order=PromptOrder(11)).save(tmp_path)
    assert json.loads((tmp_path / "rollout_state.json").read_text())["prompt_order"] == {"seed": 11}
    state = RolloutState.load(tmp_path)
    assert state.prompt_order == PromptOrder(11)
    state.check_prompt_order(PromptOrder(11), tmp_path)
    with pytest.raises(
        ValueError, match=r"shuffled with seed 11, this config shuffled with seed 42.*data_seed=11"
    ):
        state.check_prompt_order(PromptOrder(42), tmp_path)
    with pytest.raises(ValueError, match="in dataset order.*train_sampling_strategy='random'"):
        state.check_prompt_order(PromptOrder(None), tmp_path)
    RolloutState(prompt_order=PromptOrder(None)).save(tmp_path)
    with pytest.raises(ValueError, match="train_sampling_strategy='sequential'"):
        RolloutState.load(tmp_path).check_prompt_order(PromptOrder(42), tmp_path)
    # A TRL checkpoint counts prompts in the dataset's order (TRL's worker reads it in order).
    (tmp_path / "rollout_state.json").write_text(json.dumps({"prompt_index": 3, "model_version": 2}))
    RolloutState.load(tmp_path).check_prompt_order(PromptOrder(None), tmp_path)
    with pytest.raises(ValueError, match="train_sampling_strategy='sequential'"):
        RolloutState.load(tmp_path).check_prompt_order(PromptOrder(42), tmp_path)
    # An asyncgrpo checkpoint older than the recorded order: resumed in the config's, unchecked.
    (tmp_path / "rollout_state.json").write_text(json.dumps({"first_untrained_index": 3}))
    RolloutState.load(tmp_path).check_prompt_order(PromptOrder(42), tmp_path)


def test_resuming_a_checkpoint_in_another_order_fails_before_training(tiny_model_dir, tmp_path):
    """The trainer checks the order when it reads the checkpoint, before it reaches any server."""
    pytest.importorskip("datasets")
    from datasets import Dataset
    from transformers import TrainerState

    from asyncgrpo import AsyncGRPOTrainer

    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(tiny_model_dir, checkpoint)
    TrainerState(global_step=2).save_to_json(str(checkpoint / "trainer_state.json"))
    RolloutState(first_untrained_index=5, prompt_order=PromptOrder(1)).save(checkpoint)
    args = config(tmp_path, data_seed=2, gradient_checkpointing=False, vllm_server_timeout=1)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": str(i)}] for i in range(8)]})
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir), lambda completions, **_: [0.0] * len(completions), args, dataset
    )
    with pytest.raises(ValueError, match="shuffled with seed 1, this config shuffled with seed 2"):
        trainer.train(resume_from_checkpoint=str(checkpoint))


# -- the base Trainer's loop settings ----------------------------------------------------------------------


def test_empty_device_cache_every_n_optimizer_steps(monkeypatch):
    cleared = []
    monkeypatch.setattr(base_loop_settings, "clear_device_cache", lambda: cleared.append(True))
    callback = EmptyDeviceCache()
    for every, expected in ((None, 0), (3, 2)):
        cleared.clear()
        args = SimpleNamespace(torch_empty_cache_steps=every)
        for step in range(1, 8):
            callback.on_step_end(args, SimpleNamespace(global_step=step), None)
        assert len(cleared) == expected  # every=3: after steps 3 and 6


def test_input_tokens_seen_counts_forwarded_or_padded_tokens(tmp_path):
    def seen(mode):
        return input_tokens_seen(config(tmp_path, include_num_input_tokens_seen=mode), 300, 512)

    assert (seen("no"), seen(False), seen("non_padding"), seen("all"), seen(True)) == (0, 0, 300, 512, 512)


def test_every_field_here_is_documented():
    configuration = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    for name in (
        "per_device_train_batch_size",
        "train_sampling_strategy",
        "data_seed",
        "torch_empty_cache_steps",
        "include_num_input_tokens_seen",
        "save_on_each_node",
    ):
        assert f"`{name}`" in configuration, name
