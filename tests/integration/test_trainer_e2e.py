"""AsyncGRPOTrainer end to end on CPU against a real vLLM server (tiny model)."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip(
    "datasets", reason="datasets is not installed (a GPU host may lack the non-torch dependencies)"
)
pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

import torch  # noqa: E402
from conftest import make_config  # noqa: E402
from datasets import Dataset  # noqa: E402
from recording_tracker import RecordingTracker  # noqa: E402
from reward_examples import (  # noqa: E402
    MULTI_TASK_DATASET,
    async_reward_func,
    coding_reward_func,
    format_reward_func,
    length_reward_func,
    math_reward_func,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from worker_side import (  # noqa: E402 (what the rollout worker imports: tests/support/worker_side.py says why)
    CurriculumRolloutLoop,
    only_flagged_rows_vary,
    positive_if_even_start,
    prompts,
    saturating_prompts,
    saturating_reward,
    token_parity_reward,
)

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from asyncgrpo.generation.client import SamplingParams, VLLMClient, policy_label  # noqa: E402
from asyncgrpo.trainer.prompt_ledger import PromptLedger, RolloutState  # noqa: E402

pytestmark = pytest.mark.vllm

# Metric names (docs/metrics.md) that a plain single-turn run must log (tools/env ones need agents).
EXPECTED_METRICS = [
    "num_tokens",
    "loss",
    "grad_norm",
    "learning_rate",
    "entropy",
    "reward",
    "reward_trained",
    "reward_group_std",
    "frac_zero_std_groups",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/duplicate_frac",
    "rewards/token_parity_reward/mean",
    "rewards/token_parity_reward/group_std",
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
    "sampling/masked_mean",
    "sampling/masked_tokens/ratio_low",
    "sampling/masked_sequences/any",
    "sampling/mismatch_kl/mean",
    "sampling/mismatch_kl/max",
    "sampling/mismatch_kl/fresh_mean",
    "sampling/sampler_mass",
    "clip_ratio/region_mean",
    "clip_ratio/low_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_mean",
    "clip_ratio/high_max",
    "rollout/duration_s",
    "rollout/generated_tokens_per_s",
    "rollout/concurrency",
    "rollout/concurrency_cap",
    "rollout/turns_mean",
    "rollout/turns_max",
    "rollout/samples_per_rollout",
    "rollout/score_queue_size",
    "rollout/queue_size",
    "rollout/score_s",
    "rollout/score_wait_s",
    "rollout/vllm_retry_count",
    "rollout/vllm_kv_cache_usage_frac",
    "rollout/vllm_running_requests",
    "rollout/vllm_queued_requests",
    "rollout/vllm_preemption_count",
    "sample/forwarded_tokens_mean",
    "sample/forwarded_tokens_max",
    "sample/trained_tokens_mean",
    "sample/time_in_queue_s",
    "sample/staleness_mean",
    "sample/staleness_max",
    "batch/forwarded_tokens_per_step",
    "batch/trained_tokens_per_step",
    "batch/samples_per_step",
    "batch/groups_per_step",
    "batch/microbatches_per_step",
    "batch/masked_token_frac",
    "batch/samples_per_row",
    "batch/row_tokens_mean",
    "batch/row_tokens_max",
    "batch/row_fill_frac",
    "batch/row_imbalance",
    "batch/packing_ratio",
    "batch/pad_frac",
    "perf/step_s",
    "perf/fwd_bwd_s",
    "perf/fwd_s",
    "perf/optimizer_s",
    "perf/rollout_wait_s",
    "perf/weight_sync_s",
    "perf/weight_sync_pause_s",
    "perf/weight_sync_barrier_s",
    "perf/weight_sync_transfer_s",
    "perf/fwd_bwd_forwarded_tokens_per_s",
    "perf/wall_clock_forwarded_tokens_per_s",
    "perf/wall_clock_trained_tokens_per_s",
]
PROBE = [952, 648, 198, 287, 260, 294, 10, 18, 30, 950, 198, 952, 653, 198]


def server_greedy(url: str) -> list[int]:
    async def run():
        async with VLLMClient(url, timeout=60) as client:
            return (
                await client.complete(PROBE, SamplingParams(max_tokens=12, temperature=0.0), seed=0)
            ).token_ids.tolist()

    return asyncio.run(run())


def hf_greedy(model, steps: int = 12) -> list[int]:
    ids = list(PROBE)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROBE) :]


def restore_server(url: str, model_dir) -> None:
    async def run():
        async with VLLMClient(url, timeout=60) as client:
            await client.reload_weights(str(model_dir), version=policy_label(0))
            # Unsalted requests of later tests must not reuse prefixes cached by the trained weights.
            await client.reset_prefix_cache()

    asyncio.run(run())


@pytest.fixture(autouse=True)
def shared_server_weights_restored(request, tiny_model_dir):
    """Every training run here syncs its weights into the shared server: put the originals back."""
    yield
    if "vllm_server" in request.fixturenames:
        restore_server(request.getfixturevalue("vllm_server").url, tiny_model_dir)


def test_training_steps_change_the_weights_the_server_runs_and_log_the_documented_metrics(
    vllm_server, tiny_model_dir, tmp_path, monkeypatch
):
    """Also: report_to reaches a tracker through transformers' own callback (trackio's, on a recording
    stand-in of the trackio module), and log_completions sends it the completions as a table."""
    tracker = RecordingTracker("trackio")
    monkeypatch.setitem(sys.modules, "trackio", tracker)
    before_server = server_greedy(vllm_server.url)
    args = make_config(
        vllm_server,
        tmp_path,
        max_steps=3,
        learning_rate=3e-2,
        max_grad_norm=0.0,
        skip_memory_metrics=False,
        report_to=["trackio"],
        log_completions=True,
        num_completions_to_print=3,
    )
    trainer = AsyncGRPOTrainer(str(tiny_model_dir), token_parity_reward, args, train_dataset=prompts())
    initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    try:
        output = trainer.train()
        after_server = server_greedy(vllm_server.url)
        trained_model = trainer.model.eval()
        expected = hf_greedy(trained_model)
    finally:
        restore_server(vllm_server.url, tiny_model_dir)
    assert output.global_step == 3
    changed = [
        name for name, p in trained_model.named_parameters() if not torch.equal(p.detach(), initial[name])
    ]
    assert len(changed) == len(initial), "every parameter must have moved"
    # The server really runs the new weights: its greedy output is the trained model's, not the old one.
    assert after_server == expected
    assert after_server != before_server
    logged = set().union(*(entry.keys() for entry in trainer.state.log_history))
    missing = [name for name in EXPECTED_METRICS if name not in logged]
    assert not missing, f"metrics never logged: {missing}"
    first = trainer.state.log_history[0]
    assert first["batch/microbatches_per_step"] == 1 and first["batch/samples_per_step"] > 0
    assert 0.0 <= first["frac_zero_std_groups"] <= 1.0
    # skip_memory_metrics=False: the base Trainer's memory metrics close the run, as its own loop does.
    assert "train_mem_cpu_alloc_delta" in trainer.state.log_history[-1]
    assert not trainer._run.session.mismatch_watch.warned  # a float32 server agrees with the trainer
    # Every step logs its loss (a step's window may hold no finished group, so no reward, on a busy machine).
    metrics = [entry for entry in tracker.logged if "train/loss" in entry]
    tables = [entry["completions"] for entry in tracker.logged if "completions" in entry]
    assert len(metrics) == len(tables) == 3, tracker.logged
    for step, table in enumerate(tables, start=1):
        frame = table.dataframe
        assert list(frame.columns) == ["step", "prompt", "completion", "reward", "advantage"]
        assert 0 < len(frame) <= 3 and set(frame["step"]) == {step}
        assert all(isinstance(text, str) and text for text in frame["prompt"])


def test_one_epoch_ends_training_once_every_prompt_is_counted(vllm_server, tiny_model_dir, tmp_path):
    """Without max_steps, num_train_epochs counts prompts (docs/configuration.md): one epoch over six
    prompts stops once six prompts were trained or consumed without samples."""
    args = make_config(vllm_server, tmp_path, num_train_epochs=1, max_steps=-1)
    trainer = AsyncGRPOTrainer(str(tiny_model_dir), token_parity_reward, args, train_dataset=prompts(6))
    output = trainer.train()
    assert output.global_step >= 1
    assert trainer._run.ledger.epoch_prompts >= 6 and trainer.state.epoch >= 1.0
    ledger = trainer._run.ledger
    watermark, resolved_after = ledger.state()
    assert watermark + len(resolved_after) >= ledger.epoch_prompts, "a counted prompt is resolved"


class EpochEnds(TrainerCallback):
    def __init__(self):
        self.epochs: list[float] = []

    def on_epoch_end(self, args, state, control, **kwargs):
        self.epochs.append(state.epoch)


def test_an_epoch_whose_last_prompts_bring_no_step_ends_whole(vllm_server, tiny_model_dir, tmp_path):
    """Training ends when the last prompts are consumed while a step waits for samples: here one row
    brings 4 samples, fewer tokens than a step takes, and the other rows' groups score alike and are
    dropped. Those prompts count: the epoch ends whole for on_epoch_end and the state (1.0 or more, not the
    figure of the last step taken; a full suite once saw 1.875 of 2 epochs that way)."""
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"Say something about {i}."}] for i in range(6)],
            "varies": [True] + [False] * 5,
        }
    )
    ends = EpochEnds()
    args = make_config(vllm_server, tmp_path, num_train_epochs=1, max_steps=-1)
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir), only_flagged_rows_vary, args, train_dataset=dataset, callbacks=[ends]
    )
    trainer.train()
    assert trainer.state.global_step == 0, "4 samples of one prompt fill no step of token_budget=256"
    # (A prompt of the next epoch may have been consumed too: it counts toward the epoch figure.)
    assert trainer._run.ledger.epoch_prompts >= 6
    assert ends.epochs == [trainer.state.epoch] and trainer.state.epoch >= 1.0


# -- TRL's documented code examples, with only the import changed --------------------------------


def test_documented_reward_examples_train(vllm_server, tiny_model_dir, tmp_path):
    """Examples 1, 2, 4 and 5 of the documentation's custom reward functions
    (tests/support/reward_examples.py) together on example 4's dataset: each is called and logged under its
    own name. The random tiny model's completions often all run to the length cap and answer nothing, so the
    examples alone can score a whole group the same; token_parity_reward keeps groups apart (something to
    train)."""
    reward_funcs = [
        length_reward_func,
        format_reward_func,
        math_reward_func,
        coding_reward_func,
        async_reward_func,
    ]
    trainer = AsyncGRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=[*reward_funcs, token_parity_reward],
        args=make_config(vllm_server, tmp_path, max_steps=2),
        train_dataset=Dataset.from_list(MULTI_TASK_DATASET),
    )
    trainer.train()
    logged = set().union(*(entry.keys() for entry in trainer.state.log_history))
    for function in reward_funcs:
        assert f"rewards/{function.__name__}/mean" in logged


# TRL's documented CurriculumRolloutLoop, defined at module level (the worker process re-imports it): in
# tests/support/worker_side.py, so that the worker imports no test module. Its config subclass stays here: the
# worker gets the config's values, not the class.


@dataclass
class CurriculumConfig(AsyncGRPOConfig):
    pass_rate_cap: float = 0.9


class CurriculumTrainer(AsyncGRPOTrainer):
    loop_cls = CurriculumRolloutLoop


def test_documented_curriculum_loop_with_config_subclass(vllm_server, tiny_model_dir, tmp_path):
    config = make_config(vllm_server, tmp_path, config_class=CurriculumConfig, max_steps=2, num_generations=8)
    assert config.pass_rate_cap == 0.9
    trainer = CurriculumTrainer(
        model=str(tiny_model_dir), reward_funcs=positive_if_even_start, args=config, train_dataset=prompts(12)
    )
    trainer.train()
    assert trainer.state.global_step == 2


def test_the_config_subclass_field_reaches_the_worker(vllm_server, tiny_model_dir, tmp_path):
    """With pass_rate_cap=0 the curriculum filter rejects every prompt: the worker says so, since no
    sample could ever reach the trainer."""
    from asyncgrpo.rollout.worker import RolloutWorkerError

    config = make_config(vllm_server, tmp_path, config_class=CurriculumConfig, max_steps=2, pass_rate_cap=0.0)
    trainer = CurriculumTrainer(
        model=str(tiny_model_dir), reward_funcs=positive_if_even_start, args=config, train_dataset=prompts(12)
    )
    with pytest.raises(RolloutWorkerError, match="filter_prompt rejected every prompt of epoch 0"):
        trainer.train()


def test_quick_start_shape_with_accuracy_reward(vllm_server, tiny_model_dir, tmp_path):
    """TRL's documented quick start: model, accuracy_reward, a dataset with a `solution` column. The random
    tiny model never writes a \\boxed{} answer, so every group scores 0: the run must say so and stop
    after one pass over the prompts instead of waiting forever."""
    from asyncgrpo.rewards import accuracy_reward
    from asyncgrpo.trainer.intake import NoTrainingSignalError

    dataset = Dataset.from_dict(
        {
            "prompt": [
                [{"role": "user", "content": f"What is {i} + {i}? Put it in \\boxed{{}}."}] for i in range(8)
            ],
            "solution": [str(2 * i) for i in range(8)],
        }
    )
    trainer = AsyncGRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=accuracy_reward,
        train_dataset=dataset,
        args=make_config(vllm_server, tmp_path, max_steps=1),
    )
    with pytest.raises(NoTrainingSignalError, match="whole pass over the dataset"):
        trainer.train()


def test_a_run_that_saturates_ends_gracefully_and_the_demo_prints_its_figures(
    vllm_server, tiny_model_dir, tmp_path, caplog, capsys
):
    """A run that trained, then went a whole pass over its 8 prompts with every group at one reward
    (even rows always right, odd rows always wrong: saturating_reward), ends as at max_steps
    (docs/reliability.md, "A pass without signal"): the warning counts and names the prompts always
    and never solved, the final checkpoint and evaluation are written, on_train_end runs, and the
    demo's figures line comes out of its history."""
    import re

    from asyncgrpo.cli.demo import report_figures

    class EndRecorder(TrainerCallback):
        ended_at = None

        def on_train_end(self, args, state, control, **kwargs):
            EndRecorder.ended_at = state.global_step

    args = make_config(
        vllm_server,
        tmp_path,
        max_steps=50,
        token_budget=0,  # rows of 4 samples: the 16 samples of the 4 varying groups make 3 steps
        per_device_train_batch_size=4,
        save_strategy="steps",
        save_steps=1000,
        eval_strategy="steps",
        eval_steps=1000,
        eval_on_start=True,
        num_generations_eval=2,
        max_completion_length=4,
    )
    eval_rows = saturating_prompts(2, varying=0)
    trainer = AsyncGRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=saturating_reward,
        train_dataset=saturating_prompts(8, varying=4),
        eval_dataset=eval_rows,
        args=args,
        callbacks=[EndRecorder()],
    )
    trainer.train()
    steps = trainer.state.global_step
    assert 1 <= steps < 50 and EndRecorder.ended_at == steps
    warning = re.search(
        r"always solves (\d+) \(.* never solves (\d+) \(.*dataset rows ([\d, ]+)\) or add harder.*"
        r"never-solved prompts \(rows ([\d, ]+)\)",
        caplog.text,
    )
    assert warning, caplog.text
    solved, unsolved = int(warning[1]), int(warning[2])
    assert solved + unsolved <= 8 and solved and unsolved  # distinct prompts of the last pass of 8 groups
    assert all(int(row) % 2 == 0 for row in warning[3].split(", "))
    assert all(int(row) % 2 == 1 for row in warning[4].split(", "))
    assert "Training ends here, as at max_steps" in caplog.text
    assert (tmp_path / f"checkpoint-{steps}" / "rollout_state.json").exists()
    evaluated_at = [entry["step"] for entry in trainer.state.log_history if "eval_pass@1" in entry]
    assert evaluated_at == [0, steps]  # eval_on_start, then the final evaluation of the last step
    report_figures(trainer.state.log_history, minutes=1.0, seed=0)
    assert f"steps={steps} minutes=1.0 seed=0" in capsys.readouterr().out


# -- checkpoint and resume ------------------------------------------------------------------------------


def record_consumed(monkeypatch) -> list[int]:
    consumed: list[int] = []
    original = PromptLedger._consume

    def recording(self, stream_index):
        consumed.append(stream_index)
        original(self, stream_index)

    monkeypatch.setattr(PromptLedger, "_consume", recording)
    return consumed


def test_checkpoint_then_resume_continues_prompts_and_versions(
    vllm_server, tiny_model_dir, tmp_path, monkeypatch
):
    dataset = prompts(60)
    args = make_config(vllm_server, tmp_path, max_steps=3, save_strategy="steps", save_steps=3)
    first_run = record_consumed(monkeypatch)
    AsyncGRPOTrainer(str(tiny_model_dir), token_parity_reward, args, train_dataset=dataset).train()
    checkpoint = Path(tmp_path) / "checkpoint-3"
    state = RolloutState.load(checkpoint)
    assert state is not None and state.model_version == 3
    assert (
        json.loads((checkpoint / "rollout_state.json").read_text())["first_untrained_index"]
        == state.first_untrained_index
    )
    trained_before = set(range(state.first_untrained_index)) | set(state.consumed_after)
    assert trained_before == set(first_run), "the checkpoint records exactly the prompts consumed"

    monkeypatch.undo()
    second_run = record_consumed(monkeypatch)
    resumed_args = make_config(vllm_server, tmp_path, max_steps=5, save_strategy="steps", save_steps=5)
    resumed = AsyncGRPOTrainer(str(tiny_model_dir), token_parity_reward, resumed_args, train_dataset=dataset)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    try:
        assert resumed.state.global_step == 5
        assert RolloutState.load(Path(tmp_path) / "checkpoint-5").model_version == 5
        assert not trained_before & set(second_run), "a prompt trained before the checkpoint came back"
        assert len(second_run) == len(set(second_run))
        everything = trained_before | set(second_run)
        watermark = RolloutState.load(Path(tmp_path) / "checkpoint-5").first_untrained_index
        assert set(range(watermark)) <= everything, "a prompt before the resume position was skipped"
        assert min(second_run) >= state.first_untrained_index
    finally:
        restore_server(vllm_server.url, tiny_model_dir)


def test_trainer_tokenizer_and_model_defaults(vllm_server, tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.pad_token = None
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trainer = AsyncGRPOTrainer(
        model, token_parity_reward, make_config(vllm_server, tmp_path), prompts(), processing_class=tokenizer
    )
    assert trainer.processing_class.pad_token == tokenizer.eos_token
    assert trainer.model.config._attn_implementation == "asyncgrpo_tree"
