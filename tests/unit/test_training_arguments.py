"""Every TrainingArguments field is honoured, warns once that it has no effect, or is refused
(asyncgrpo/config/training_arguments_table.py): the table covers every field of the installed
transformers, each warning and refusal fires, and the fields only the base Trainer's data loader or
loop would read are honoured here (data_seed, train_sampling_strategy, per_device_train_batch_size with
token_budget <= 0, torch_empty_cache_steps, include_num_input_tokens_seen, torch_compile's mode and
backend) or warn."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import TrainingArguments

from asyncgrpo import AsyncGRPOConfig
from asyncgrpo.config import trl_compat
from asyncgrpo.config.training_arguments import TrainingArgumentsDefaults
from asyncgrpo.config.training_arguments_table import HONOURED, REFUSED, TRAINING_ARGUMENTS, WARNS
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
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.config.trl_compat"):
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
    per_device, sampling, save = sorted(messages, key=lambda message: "pts".index(message[0]))
    assert "per_device_train_batch_size=16 has no effect" in per_device
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
    assert ["with a token budget" in message for message in warnings_once()] == [True]


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
    configuration = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    for name in (
        "per_device_train_batch_size",
        "train_sampling_strategy",
        "data_seed",
        "torch_empty_cache_steps",
        "include_num_input_tokens_seen",
        "save_on_each_node",
    ):
        assert f"`{name}`" in configuration, name


# -- every TrainingArguments field ---------------------------------------------------------------------

# A value of each field that warns or is refused (with what it needs to be a valid TrainingArguments).
NOT_HONOURED_EXAMPLES = {
    "per_device_train_batch_size": {"per_device_train_batch_size": 16},
    "average_tokens_across_devices": {"average_tokens_across_devices": False},
    "bf16_full_eval": {"bf16_full_eval": True, "use_cpu": True},
    "fp16_full_eval": {"fp16_full_eval": True},
    "liger_kernel_config": {"liger_kernel_config": {"rms_norm": True}},
    "logging_nan_inf_filter": {"logging_nan_inf_filter": False},
    "per_device_eval_batch_size": {"per_device_eval_batch_size": 4},
    "prediction_loss_only": {"prediction_loss_only": True},
    "eval_do_concat_batches": {"eval_do_concat_batches": False},
    "eval_use_gather_object": {"eval_use_gather_object": True},
    "eval_accumulation_steps": {"eval_accumulation_steps": 2},
    "include_for_metrics": {"include_for_metrics": ["inputs"]},
    "batch_eval_metrics": {"batch_eval_metrics": True},
    "save_on_each_node": {"save_on_each_node": True},
    "accelerator_config": {"accelerator_config": {"even_batches": False}},
    "dataloader_drop_last": {"dataloader_drop_last": True},
    "dataloader_num_workers": {"dataloader_num_workers": 2},
    "dataloader_pin_memory": {"dataloader_pin_memory": False},
    "dataloader_persistent_workers": {"dataloader_persistent_workers": True},
    "dataloader_prefetch_factor": {"dataloader_prefetch_factor": 2, "dataloader_num_workers": 2},
    "dataloader_multiprocessing_context": {"dataloader_multiprocessing_context": "spawn"},
    "dataloader_in_order": {"dataloader_in_order": False},
    "label_names": {"label_names": ["labels"]},
    "train_sampling_strategy": {"train_sampling_strategy": "group_by_length"},
    "length_column_name": {"length_column_name": "num_tokens"},
    "ddp_find_unused_parameters": {"ddp_find_unused_parameters": True},
    "ddp_bucket_cap_mb": {"ddp_bucket_cap_mb": 25},
    "ddp_broadcast_buffers": {"ddp_broadcast_buffers": False},
    "ddp_static_graph": {"ddp_static_graph": True},
    "activation_checkpointing": {"activation_checkpointing": True},
    "activation_checkpointing_kwargs": {"activation_checkpointing_kwargs": {"use_reentrant": False}},
    "label_smoothing_factor": {"label_smoothing_factor": 0.1},
    "use_liger_kernel": {"use_liger_kernel": True},
    "neftune_noise_alpha": {"neftune_noise_alpha": 5.0},
    "auto_find_batch_size": {"auto_find_batch_size": True},
    "enable_jit_checkpoint": {"enable_jit_checkpoint": True},
    "ignore_data_skip": {"ignore_data_skip": False},
    "remove_unused_columns": {"remove_unused_columns": True},
    "deepspeed": {"deepspeed": {"zero_optimization": {"stage": 2}}},
}


def test_every_training_arguments_field_has_a_rule():
    """A field transformers adds in a later release fails here until the table says what becomes of
    it; the table names nothing but TrainingArguments' fields and the two asyncgrpo declares for TRL."""
    transformers_fields = {field.name for field in dataclasses.fields(TrainingArguments)}
    declared_here = set(vars(TrainingArgumentsDefaults)["__annotations__"]) - transformers_fields
    assert sorted(transformers_fields - set(TRAINING_ARGUMENTS)) == []
    assert set(TRAINING_ARGUMENTS) - transformers_fields <= declared_here
    assert all(rule.kind in (HONOURED, WARNS, REFUSED) and rule.text for rule in TRAINING_ARGUMENTS.values())
    not_honoured = {name for name, rule in TRAINING_ARGUMENTS.items() if rule.kind != HONOURED}
    assert set(NOT_HONOURED_EXAMPLES) == not_honoured, "give each warning or refusal an example here"


@pytest.mark.parametrize("name", sorted(NOT_HONOURED_EXAMPLES))
def test_a_field_without_effect_warns_once_and_a_refused_one_fails(name, tmp_path, warnings_once):
    example = NOT_HONOURED_EXAMPLES[name]
    if TRAINING_ARGUMENTS[name].kind == REFUSED:
        with pytest.raises(ValueError, match=rf"{name}=.* is not supported: \w"):
            config(tmp_path, **example)
        return
    for _ in range(2):
        config(tmp_path, **example)
    mine = [message for message in warnings_once() if message.startswith(f"{name}=")]
    assert len(mine) == 1 and "has no effect in asyncgrpo: " in mine[0], warnings_once()


def test_a_warm_up_or_a_schedule_step_given_as_a_fraction_of_an_unknown_length_is_refused(tmp_path):
    """Without max_steps the run's length is unknown (it plans 2**62 steps): a fractional warm-up
    would last forever, a fractional eval_steps would never evaluate."""
    with pytest.raises(
        ValueError, match=r"warmup_steps=0.1 .*whole number of optimizer steps.*max_steps > 0"
    ):
        config(tmp_path, lr_scheduler_type="constant_with_warmup", warmup_steps=0.1)
    with pytest.raises(ValueError, match=r"eval_steps=0.5: .*need max_steps > 0"):
        config(tmp_path, eval_strategy="steps", eval_steps=0.5)
    config(tmp_path, lr_scheduler_type="constant_with_warmup", warmup_steps=10)
    config(tmp_path, lr_scheduler_type="constant_with_warmup", warmup_steps=0.1, max_steps=100)


def test_tensor_parallelism_is_refused():
    with pytest.raises(ValueError, match="tp_size=2 is not supported"):
        AsyncGRPOConfig(output_dir="x", parallelism_config=SimpleNamespace(cp_size=1, sp_size=1, tp_size=2))


def test_torch_compile_mode_and_backend_reach_the_compiled_layers(monkeypatch):
    """Setting either turns torch_compile on (as in transformers) and each decoder layer is compiled
    with them, not with torch's defaults."""
    import torch

    from asyncgrpo.cli.tiny_model import build_model, build_tokenizer
    from asyncgrpo.trainer.compile import compile_decoder_layers, take_compile_options

    args = AsyncGRPOConfig(
        "x", report_to="none", torch_compile_mode="max-autotune-no-cudagraphs", torch_compile_backend="eager"
    )
    assert args.torch_compile
    options = take_compile_options(args)
    assert options == {"mode": "max-autotune-no-cudagraphs", "backend": "eager"}
    assert not args.torch_compile, "taken off the trainer's args: the base Trainer compiles nothing"
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: compiled.append(kwargs))
    model = build_model(build_tokenizer())
    assert compile_decoder_layers(model, **options) == len(compiled) > 0
    assert all(kwargs == {"dynamic": True, **options} for kwargs in compiled)
    assert take_compile_options(AsyncGRPOConfig("x", report_to="none", torch_compile=False)) is None


def configuration_page_rows(section: str) -> dict[str, str]:
    """field -> the second cell of its row in the table under `section` of docs/configuration.md."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    text = page[page.index(f"\n## {section}\n") :]
    text = text[: text.find("\n## ", 1)]
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = [cell.strip() for cell in line.split("|")[1:-1]]
            for name in re.findall(r"`([^`]+)`", cells[0]):
                rows[name] = cells[1]
    return rows


def test_the_configuration_page_places_every_training_arguments_field_as_the_code_does():
    rows = configuration_page_rows("Every TrainingArguments field")
    assert sorted(set(TRAINING_ARGUMENTS) - set(rows)) == [], "fields missing from the page's table"
    assert sorted(set(rows) - set(TRAINING_ARGUMENTS)) == [], "the page's table names other fields"
    wrong = {
        name: (rows[name], rule.kind) for name, rule in TRAINING_ARGUMENTS.items() if rows[name] != rule.kind
    }
    assert not wrong, f"page's verdict against the code's: {wrong}"
