"""AsyncDistillationConfig: TRL 1.16's fields with their names and defaults, our pipeline's fields beside
them, and bad values refused at construction with a message naming the field."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from asyncgrpo import AsyncDistillationConfig, AsyncGRPOConfig

# Every field TRL 1.16's AsyncDistillationConfig declares itself, at TRL's defaults.
TRL_116_FIELDS = dict(  # noqa: C408 (keyword form: the fields read as a config call)
    model_init_kwargs=None, dtype="float32", ignore_data_skip=True, trust_remote_code=False,
    learning_rate=1e-6, logging_steps=1, max_completion_length=2048, temperature=1.0, top_p=1.0, top_k=0,
    min_p=None, repetition_penalty=1.0, chat_template_kwargs=None,
    vllm_server_base_url="http://localhost:8000", vllm_server_timeout=240.0, teacher_server_urls=None,
    request_timeout=600, weight_sync_timeout=1800, beta=0.0, teacher_temperature=1.0, teacher_top_k=8,
    add_tail_bucket=True, token_budget=None, max_inflight_tasks=-1, max_staleness=4, queue_maxsize=1024,
    weight_sync_steps=1, heartbeat_stale_after_s=300.0, log_completions=False, log_completions_steps=100,
    num_completions_to_print=None,
)  # fmt: skip


def test_every_trl_116_field_is_accepted_with_trls_defaults(tmp_path):
    config = AsyncDistillationConfig(str(tmp_path), report_to="none", **TRL_116_FIELDS)
    assert config.teacher_server_urls == {"default": "http://localhost:8001"}
    defaults = AsyncDistillationConfig(str(tmp_path), report_to="none")
    for name, value in TRL_116_FIELDS.items():
        if name in ("teacher_server_urls", "vllm_server_timeout", "request_timeout", "weight_sync_timeout"):
            continue  # None resolved above; ours keep AsyncGRPOConfig's documented timeouts
        assert getattr(defaults, name) == value, name
    # One completion per row (TRL's distillation), no sampler top log-probs asked for.
    assert (defaults.num_generations, defaults.score_centering) == (1, False)
    assert isinstance(defaults, AsyncGRPOConfig)  # every pipeline field means what it means for GRPO


def test_teacher_urls_come_as_a_dict_a_json_object_or_one_url(tmp_path):
    def urls(value):
        config = AsyncDistillationConfig(str(tmp_path), report_to="none", teacher_server_urls=value)
        return config.teacher_server_urls

    assert urls({"math": "http://a:1/", "code": "http://b:2"}) == {"math": "http://a:1", "code": "http://b:2"}
    assert urls('{"math": "http://a:1"}') == {"math": "http://a:1"}
    assert urls("http://a:1") == {"default": "http://a:1"}


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"beta": 1.5}, "beta=1.5 must be in [0, 1]"),
        ({"beta": -0.1}, "beta=-0.1 must be in [0, 1]"),
        ({"beta": 1.0, "add_tail_bucket": False}, "the divergence is 0 and nothing trains"),
        ({"teacher_temperature": 0.0}, "teacher_temperature=0.0 must be > 0"),
        ({"teacher_top_k": 0}, "teacher_top_k=0 must be >= 1"),
        ({"teacher_server_urls": {}}, "teacher_server_urls has no teacher"),
        ({"teacher_server_urls": {"math": "localhost:8001"}}, "teacher_server_urls['math']"),
        ({"teacher_server_urls": ["http://a:1"]}, "teacher_server_urls must be a dict"),
        ({"num_generations": 0}, "num_generations=0 must be >= 1"),
        ({"sync_ref_model": True}, "distillation keeps no reference model"),
    ],
)
def test_bad_values_are_refused_naming_the_field(tmp_path, overrides, says):
    with pytest.raises(ValueError, match="AsyncDistillationConfig: ") as error:
        AsyncDistillationConfig(str(tmp_path), report_to="none", **overrides)
    assert says in str(error.value)


def test_grpo_still_needs_a_group_and_log_completions_steps_warns(tmp_path, caplog, monkeypatch):
    with pytest.raises(ValueError, match="AsyncGRPOConfig: num_generations=1"):
        AsyncGRPOConfig(str(tmp_path), report_to="none", num_generations=1)
    monkeypatch.setattr("asyncgrpo.config.trl_compat._warned", set())
    with caplog.at_level(logging.WARNING):
        AsyncDistillationConfig(str(tmp_path), report_to="none", log_completions_steps=5)
    assert "log_completions_steps=5 has no effect" in caplog.text


def test_every_teacher_field_has_help_text_naming_its_default():
    own = {"teacher_server_urls", "teacher_temperature", "teacher_top_k", "add_tail_bucket", "beta"}
    for field in dataclasses.fields(AsyncDistillationConfig):
        if field.name in own | {"num_generations", "score_centering", "log_completions_steps"}:
            default = "None" if field.default is None else str(field.default)
            assert default in field.metadata["help"], field.name
