"""Bad input fails fast with a message that says what is wrong (no server needed for most)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

pytest.importorskip(
    "datasets", reason="datasets is not installed (a GPU host may lack the non-torch dependencies)"
)
pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from asyncgrpo.generation.client import VLLMUnavailableError  # noqa: E402


def some_reward(completions, **kwargs):
    return [0.0] * len(completions)


def conversational(n: int = 4) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(n)]})


def config(tmp_path, **overrides) -> AsyncGRPOConfig:
    options = dict(output_dir=str(tmp_path), report_to="none", max_steps=1, vllm_server_timeout=2.0)
    options.update(overrides)
    return AsyncGRPOConfig(**options)


def test_unknown_config_value_is_rejected():
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_generation'"):
        AsyncGRPOConfig(output_dir="x", num_generation=8)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"top_p": 0.9}, "needs top_k > 0"),
        ({"num_generations": 1}, "at least 2 rollouts"),
        ({"vllm_importance_sampling_clip_min": 2.0}, "clip_min <= 1"),
        ({"weight_sync_backend": "carrier-pigeon"}, "weight_sync_backend"),
        ({"remove_unused_columns": True}, "remove_unused_columns=True is not supported"),
        ({"use_liger_kernel": True}, "use_liger_kernel=True is not supported"),
        ({"vllm_server_base_url": "localhost:8000"}, "must start with http"),
        ({"score_centering": True, "num_sampler_logprobs": 0}, "num_sampler_logprobs > 0"),
        ({"lr_scheduler_type": "linear"}, "set max_steps, or use a constant schedule"),
        ({"logging_steps": 0.1}, "fraction of training need max_steps > 0"),
        ({"router_aux_loss_coef": -0.1}, "router_aux_loss_coef=-0.1 must be >= 0"),
    ],
)
def test_bad_config_values_fail_at_construction(overrides, message):
    with pytest.raises(ValueError, match=message):
        AsyncGRPOConfig(output_dir="x", **overrides)


def test_trl_defaults():
    args = AsyncGRPOConfig(output_dir="x")
    assert (args.logging_steps, args.learning_rate, args.gradient_checkpointing) == (1, 1e-6, True)
    assert args.lr_scheduler_type == "constant" and args.ignore_data_skip and not args.remove_unused_columns
    assert (args.num_generations, args.max_completion_length, args.max_concurrent_rollouts) == (8, 2048, 512)
    assert (args.max_staleness, args.weight_sync_steps, args.num_sampler_logprobs) == (4, 1, 8)
    assert (args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max) == (0.5, 5.0)
    assert args.score_centering and args.dtype == "float32" and args.epsilon_high == args.epsilon == 0.2
    assert args.vllm_server_urls == ["http://localhost:8000"]
    assert args.bf16 == (torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def test_several_server_urls_and_the_field_keeps_what_the_user_set():
    args = AsyncGRPOConfig(output_dir="x", vllm_server_base_url="http://a:8000, http://b:8000")
    assert args.vllm_server_urls == ["http://a:8000", "http://b:8000"]
    assert args.vllm_server_base_url == "http://a:8000, http://b:8000"  # TRL's scripts read it as set
    listed = AsyncGRPOConfig(output_dir="x", vllm_server_base_url=["http://a:8000", "http://b:8000 "])
    assert listed.vllm_server_urls == ["http://a:8000", "http://b:8000"]
    assert listed.vllm_server_base_url == ["http://a:8000", "http://b:8000 "]


def test_non_conversational_prompts_are_rejected(tiny_model_dir, tmp_path):
    dataset = Dataset.from_dict({"prompt": ["What is 2+2?"]})
    with pytest.raises(ValueError, match="conversational format"):
        AsyncGRPOTrainer(str(tiny_model_dir), some_reward, config(tmp_path), train_dataset=dataset)


def test_prompts_with_images_are_rejected(tiny_model_dir, tmp_path):
    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}]]}
    )
    with pytest.raises(ValueError, match="images are not supported"):
        AsyncGRPOTrainer(str(tiny_model_dir), some_reward, config(tmp_path), train_dataset=dataset)


def test_reward_models_are_rejected(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="reward models are not supported"):
        AsyncGRPOTrainer(
            str(tiny_model_dir), "some-org/reward-model", config(tmp_path), train_dataset=conversational()
        )
    with pytest.raises(ValueError, match="reward models are not supported"):
        AsyncGRPOTrainer(
            str(tiny_model_dir),
            [some_reward, torch.nn.Linear(2, 1)],
            config(tmp_path),
            train_dataset=conversational(),
        )


def test_context_and_sequence_parallelism_are_rejected_by_the_config():
    from accelerate import ParallelismConfig

    with pytest.raises(ValueError, match="cp_size=2 is not supported"):
        AsyncGRPOConfig(output_dir="x", parallelism_config=ParallelismConfig(cp_size=2))
    with pytest.raises(ValueError, match="sp_size=4 is not supported"):
        AsyncGRPOConfig(output_dir="x", parallelism_config=SimpleNamespace(cp_size=1, sp_size=4))


def test_deepspeed_is_rejected():
    with pytest.raises(ValueError, match="deepspeed=.* is not supported: use FSDP2"):
        AsyncGRPOConfig(output_dir="x", deepspeed={"zero_optimization": {"stage": 2}})


def test_iterable_dataset_needs_max_steps(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="set max_steps > 0"):
        AsyncGRPOTrainer(
            str(tiny_model_dir),
            some_reward,
            config(tmp_path, max_steps=-1),
            train_dataset=conversational().to_iterable_dataset(),
        )


def test_a_lambda_reward_fails_at_train_naming_it(tiny_model_dir, tmp_path):
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir),
        lambda completions, **kw: [0.0] * len(completions),
        config(tmp_path),
        train_dataset=conversational(),
    )
    with pytest.raises(TypeError, match="reward function #0 .*lambda.* cannot be sent to the rollout worker"):
        trainer.train()


def test_an_unreachable_server_fails_within_the_timeout_naming_it(tiny_model_dir, tmp_path):
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir),
        some_reward,
        config(tmp_path, vllm_server_base_url="http://127.0.0.1:9", vllm_server_timeout=2.0),
        train_dataset=conversational(),
    )
    started = time.monotonic()
    with pytest.raises(VLLMUnavailableError, match=r"http://127\.0\.0\.1:9.*asyncgrpo serve"):
        trainer.train()
    assert time.monotonic() - started < 10


@pytest.mark.vllm
def test_a_prompt_longer_than_max_model_len_fails_before_training(vllm_server, tiny_model_dir, tmp_path):
    long_prompt = [{"role": "user", "content": " ".join(["word"] * 1500)}]
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}], long_prompt]})
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir),
        some_reward,
        config(tmp_path, vllm_server_base_url=vllm_server.url, vllm_server_timeout=30),
        train_dataset=dataset,
    )
    with pytest.raises(ValueError, match="row 1: its prompt is .* tokens .* max_model_len=1024"):
        trainer.train()


@pytest.mark.vllm
def test_nccl_weight_sync_needs_a_server_with_the_nccl_engine(vllm_server, tiny_model_dir, tmp_path):
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir),
        some_reward,
        config(
            tmp_path, vllm_server_base_url=vllm_server.url, vllm_server_timeout=30, weight_sync_backend="nccl"
        ),
        train_dataset=conversational(),
    )
    with pytest.raises(ValueError, match="not started with the NCCL engine.*--weight-transfer-config"):
        trainer.train()


def test_processes_launched_but_not_joined_are_refused(monkeypatch):
    from asyncgrpo.trainer.checks import check_launch

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="launched on 2 processes.*use_cpu=True"):
        check_launch(num_processes=1, use_cpu=False)
    check_launch(num_processes=2, use_cpu=True)


def test_multi_process_limits_are_said_at_start():
    from asyncgrpo.trainer.checks import check_multi_process

    with pytest.raises(ValueError, match="not a DeepSpeed one"):
        check_multi_process(deepspeed=True, has_optimizer=False)
    with pytest.raises(ValueError, match="do not pass `optimizers`"):
        check_multi_process(deepspeed=False, has_optimizer=True)
    check_multi_process(deepspeed=False, has_optimizer=False)


def test_the_tokenizer_loads_the_revision_of_model_init_kwargs(tiny_model_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    import asyncgrpo.trainer.policy_model as policy_model

    seen = []
    load = AutoTokenizer.from_pretrained

    def recording(name, *args, **kwargs):
        seen.append(kwargs.get("revision"))
        return load(name, *args, **kwargs)

    monkeypatch.setattr(policy_model.AutoTokenizer, "from_pretrained", recording)
    args = config(tmp_path, model_init_kwargs={"revision": "main"})
    AsyncGRPOTrainer(str(tiny_model_dir), some_reward, args, train_dataset=conversational())
    assert seen == ["main"]


def test_the_trainer_leaves_the_callers_args_as_given(tiny_model_dir, tmp_path):
    """The trainer resolves torch_compile and router_aux_loss_coef on its own copy of the config."""
    args = config(tmp_path, torch_compile=True)
    trainer = AsyncGRPOTrainer(str(tiny_model_dir), some_reward, args, train_dataset=conversational())
    assert args.torch_compile and args.torch_compile_backend == "inductor"
    assert args.router_aux_loss_coef is None, "None means the model config's: the caller's args keep it"
    assert (
        trainer._compile_layers
        and not trainer.args.torch_compile
        and trainer.args.torch_compile_backend is None
    )
    assert trainer.args.router_aux_loss_coef == 0.0  # a dense model: no load-balancing loss


def test_vision_language_checkpoint_trains_on_text(tmp_path):
    """A checkpoint with a vision tower loads with the image-text-to-text class; only its language
    model trains; prompts with images fail at construction."""
    from asyncgrpo.cli.tiny_model import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "vl", arch="qwen3_5_vl")
    trainer = AsyncGRPOTrainer(str(model_dir), some_reward, config(tmp_path), train_dataset=conversational())
    assert type(trainer.model).__name__ == "Qwen3_5ForConditionalGeneration"
    trained = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and not any(".visual." in f".{name}" for name in trained)
    with_image = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": [{"type": "image", "url": "x.png"}, {"type": "text"}]}]]}
    )
    with pytest.raises(ValueError, match="prompts with images are not supported"):
        AsyncGRPOTrainer(str(model_dir), some_reward, config(tmp_path), train_dataset=with_image)


def test_resuming_an_iterable_dataset_warns_that_it_restarts_from_the_first_prompt(
    tiny_model_dir, tmp_path, caplog
):
    from asyncgrpo.trainer.checkpoint import start_trainer_state
    from asyncgrpo.trainer.prompt_ledger import RolloutState

    checkpoint = tmp_path / "checkpoint-3"
    checkpoint.mkdir()
    RolloutState(first_untrained_index=12, consumed_after=[14], epoch_prompts=12, model_version=3).save(
        checkpoint
    )
    args = config(tmp_path)
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir), some_reward, args, train_dataset=conversational().to_iterable_dataset()
    )
    with caplog.at_level("WARNING"):
        state = start_trainer_state(trainer, trainer.args, str(checkpoint), trainer.streaming).rollout
    assert "cannot be repositioned" in caplog.text
    assert (state.first_untrained_index, state.consumed_after, state.model_version) == (0, [], 3)


def test_weight_sync_barrier_is_the_wait_for_the_other_processes(monkeypatch):
    """perf/weight_sync_barrier_s is the time every process takes to reach the sync (the gather
    before it), and perf/weight_sync_s adds it to the pause and the transfer."""
    import asyncgrpo.trainer.generation_session as session_module
    from asyncgrpo.records.metrics import MetricsWindow
    from asyncgrpo.trainer.checkpoint import ResumePoint
    from asyncgrpo.trainer.prompt_ledger import RolloutState
    from asyncgrpo.weight_sync.base import SyncTimings

    def slow_gather(value):
        time.sleep(0.05)  # another process arrives 50 ms later
        return [value, value]

    monkeypatch.setattr(
        session_module, "sync_policy", lambda backend, model, version, urls: (SyncTimings(0.25, 0.5), 1000)
    )
    window = MetricsWindow()
    session = session_module.GenerationSession(
        SimpleNamespace(gather=slow_gather, is_main=True), window, ResumePoint(RolloutState(model_version=1))
    )
    session.sync_weights(torch.nn.Linear(2, 2))
    logged = window.summarize()
    assert 0.05 <= logged["perf/weight_sync_barrier_s"] < 1.0
    assert logged["perf/weight_sync_s"] == pytest.approx(0.75 + logged["perf/weight_sync_barrier_s"])
    assert (logged["perf/weight_sync_pause_s"], logged["perf/weight_sync_transfer_s"]) == (0.25, 0.5)


@pytest.mark.parametrize("injected", ["rollout_worker", "weight_transfer"])
def test_trl_protocol_objects_are_refused_naming_what_to_use_instead(tiny_model_dir, tmp_path, injected):
    with pytest.raises(NotImplementedError, match="subclass AsyncRolloutLoop"):
        AsyncGRPOTrainer(
            str(tiny_model_dir),
            some_reward,
            config(tmp_path),
            train_dataset=conversational(),
            **{injected: object()},
        )
