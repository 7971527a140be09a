"""Evaluation during training: pass@k and the figures (hand-derived), the eval settings, and against a
real vLLM server the schedule, the weights each evaluation samples, evaluate() alone and a resume."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pytest

from asyncgrpo import AsyncGRPOConfig
from asyncgrpo.rollout.eval_metrics import PromptOutcome, pass_at_k, pass_k_values, summarize

# -- pure functions ------------------------------------------------------------------------------------


def test_pass_at_k_matches_hand_counts():
    # 1 - C(n - c, k) / C(n, k), counted by hand.
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 1, 1) == 0.25  # pass@1 is c / n
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2)=3, C(4,2)=6
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # C(2,2)=1
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # C(3,3)=1, C(5,3)=10
    assert pass_at_k(4, 1, 4) == 1.0  # all four drawn: the passing one is among them
    assert pass_at_k(4, 3, 2) == 1.0  # two draws from one failure cannot both fail
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)


def test_pass_k_values_are_powers_of_two_and_n():
    assert pass_k_values(1) == [1]
    assert pass_k_values(4) == [1, 2, 4]
    assert pass_k_values(6) == [1, 2, 4, 6]


def test_summary_of_two_prompts_by_hand():
    outcomes = [
        PromptOutcome(
            np.array([1.0, 0.0, 0.0, 0.0]), {"acc": [1.0, 0.0, 0.0, 0.0]}, [3, 5, 4, 4], [0, 0, 1, 0]
        ),
        # The third rollout was scored by no source: it counts as a failure, and in no mean.
        PromptOutcome(
            np.array([1.0, 1.0, np.nan, 0.0]), {"acc": [1.0, 1.0, None, 0.0]}, [2, 2, 2, 2], [0] * 4
        ),
    ]
    figures = summarize(outcomes, threshold=1.0)
    assert figures["reward"] == pytest.approx(3 / 7)
    assert figures["reward_std"] == pytest.approx(math.sqrt(3 / 7 * 4 / 7))  # a 0/1 variable: p(1 - p)
    assert figures["rewards/acc/mean"] == pytest.approx(3 / 7)
    assert figures["pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert figures["pass@2"] == pytest.approx((1 / 2 + 5 / 6) / 2)
    assert figures["pass@4"] == 1.0
    assert figures["completions/mean_length"] == pytest.approx(24 / 8)
    assert figures["completions/clipped_ratio"] == pytest.approx(1 / 8)


def test_eval_settings_default_to_the_training_ones(tmp_path):
    args = AsyncGRPOConfig(output_dir=str(tmp_path), num_generations=6, temperature=0.7, report_to="none")
    assert (args.num_generations_eval, args.temperature_eval, args.eval_pass_threshold) == (6, 0.7, 1.0)
    best = AsyncGRPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        max_steps=4,
        eval_strategy="steps",
        eval_steps=2,
        save_steps=2,
        load_best_model_at_end=True,
    )
    assert best.metric_for_best_model == "reward" and best.greater_is_better
    with pytest.raises(ValueError, match="logs no loss"):
        AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", metric_for_best_model="loss")
    with pytest.raises(ValueError, match="temperature_eval"):
        AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", temperature_eval=-1.0)


class LabelledServers:
    """Stands for the servers' client: the weight labels they report, one answer per call."""

    def __init__(self, *answers: list[str]):
        self.answers = list(answers)

    async def weight_labels(self) -> list[str]:
        return self.answers.pop(0)


class SampledWith:
    """Stands for the EvalRunner: every prompt's rollouts pass, sampled by weights `labels`."""

    several_teachers = False  # a run without teachers

    def __init__(self, *labels: str):
        self.labels = set(labels)
        self.versions: list[int] = []

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def run(self, rows, version):
        self.versions.append(version)
        outcome = PromptOutcome(np.array([1.0, 1.0]), {"f": [1.0, 1.0]}, [3, 3], [False, False])
        return [outcome] * len(rows), set(self.labels)


def evaluate_with(servers: LabelledServers, runner: SampledWith):
    from asyncgrpo.generation.background import BackgroundLoop
    from asyncgrpo.trainer.evaluator import Evaluator

    http = BackgroundLoop()
    try:
        evaluator = Evaluator(http, servers, runner, pass_threshold=1.0)
        evaluator.start({"eval": [{}] * 3, "eval_b": [{}]}, step=7, version=3)
        joined = evaluator.join()
        evaluator.close()
        return joined
    finally:
        http.close()


def test_an_evaluation_on_one_policy_is_logged_under_each_prefix_at_its_step():
    policy = "asyncgrpo-policy-3"
    runner = SampledWith(policy)
    step, figures = evaluate_with(LabelledServers([policy], [policy], [policy], [policy]), runner)
    assert step == 7 and runner.versions == [3, 3]
    assert figures["eval_pass@2"] == 1.0 and figures["eval_b_reward"] == 1.0
    assert figures["eval_model_version"] == 3.0 and figures["eval_samples_per_second"] > 0


@pytest.mark.parametrize(
    ("labels", "sampled"),
    [
        ([["p-3", "p-4"]], ["p-3"]),  # two servers on different weights
        ([["p-3"], ["p-4"]], ["p-3"]),  # a sync landed while it ran
        ([["p-3"], ["p-3"]], ["p-3", "p-4"]),  # tokens from other weights
    ],
)
def test_an_evaluation_that_saw_other_weights_is_discarded(labels, sampled, caplog):
    with caplog.at_level("WARNING"):
        assert evaluate_with(LabelledServers(*labels), SampledWith(*sampled)) is None
    assert "evaluation of step 7 is discarded" in caplog.text


# -- against the real server -----------------------------------------------------------------------------

pytest.importorskip("datasets", reason="datasets is not installed (a GPU host may lack it)")
pytest.importorskip("msgspec", reason="msgspec is not installed (a GPU host may lack it)")

import torch  # noqa: E402
from conftest import make_config  # noqa: E402
from datasets import Dataset  # noqa: E402
from test_trainer_e2e import restore_server  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from worker_side import first_token_reward, listed_passes  # noqa: E402 (the worker imports them)

from asyncgrpo import AsyncGRPOTrainer  # noqa: E402


def rows(n: int, split: str, **columns) -> Dataset:
    data = {
        "prompt": [[{"role": "user", "content": f"Count to {i} ({split})."}] for i in range(n)],
        "split": [split] * n,
    }
    data.update(columns)
    return Dataset.from_dict(data)


class NegateHeadAtStep(TrainerCallback):
    """After the optimizer step that becomes global step `step`, the output head is negated: the next
    weight sync carries it, and greedy decoding picks each position's least likely token instead."""

    def __init__(self, step: int):
        self.step = step

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.step:
            with torch.no_grad():
                model.lm_head.weight.neg_()


def evals(trainer, name: str = "eval_reward") -> dict[int, dict]:
    return {entry["step"]: entry for entry in trainer.state.log_history if name in entry}


@pytest.mark.vllm
def test_evaluations_run_at_the_schedule_with_the_weights_of_their_step(
    vllm_server, tiny_model_dir, tmp_path
):
    args = make_config(
        vllm_server,
        tmp_path,
        max_steps=2,
        learning_rate=0.0,  # only the callback moves the weights
        eval_strategy="steps",
        eval_steps=1,
        eval_on_start=True,
        num_generations_eval=2,
        temperature_eval=0.0,
    )
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir),
        first_token_reward,
        args,
        train_dataset=rows(40, "train"),
        eval_dataset=rows(3, "eval"),
        callbacks=[NegateHeadAtStep(2)],
    )
    try:
        trainer.train()
    finally:
        restore_server(vllm_server.url, tiny_model_dir)
    measured = evals(trainer)
    assert sorted(measured) == [0, 1, 2], "eval_on_start, then every step"
    for step, entry in measured.items():
        assert entry["eval_model_version"] == step, "each evaluation sampled its own step's policy"
        for name in ("eval_pass@1", "eval_pass@2", "eval_completions/mean_length", "eval_runtime"):
            assert name in entry
        assert entry["eval_rewards/first_token_reward/mean"] == entry["eval_reward"]
    assert measured[0]["eval_reward"] == measured[1]["eval_reward"], "same weights, same greedy tokens"
    assert measured[2]["eval_reward"] != measured[1]["eval_reward"], "the negated head moved it"
    # The training run never saw an eval prompt (first_token_reward would have failed the worker), and
    # the prompt ledger counts training prompts only.
    assert trainer._run.ledger.epoch_prompts <= 40


class EpochEnds(TrainerCallback):
    """(global step, epoch) at every on_epoch_end: where transformers' "epoch" strategy evaluates."""

    def __init__(self):
        self.ends: list[tuple[int, float]] = []

    def on_epoch_end(self, args, state, control, **kwargs):
        self.ends.append((state.global_step, state.epoch))


@pytest.mark.vllm
def test_epoch_evaluations_run_at_epoch_ends_once_eval_delay_epochs_passed(
    vllm_server, tiny_model_dir, tmp_path
):
    ends = EpochEnds()
    args = make_config(
        vllm_server,
        tmp_path,
        num_train_epochs=2,
        token_budget=128,  # a step takes one or two prompts: an epoch of 8 lasts several steps
        learning_rate=0.0,
        eval_strategy="epoch",
        eval_delay=2,  # epochs: none at the first epoch's end
        num_generations_eval=2,
        temperature_eval=0.0,
    )
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir),
        first_token_reward,
        args,
        train_dataset=rows(8, "train"),
        eval_dataset=rows(2, "eval"),
        callbacks=[ends],
    )
    try:
        trainer.train()
    finally:
        restore_server(vllm_server.url, tiny_model_dir)
    (first_step, first_epoch), (last_step, last_epoch) = ends.ends  # an epoch's end, and training's
    assert 1 <= first_epoch < 2 <= last_epoch and first_step < last_step == trainer.state.global_step
    assert sorted(evals(trainer)) == [last_step], "at the epoch ends past eval_delay, not every step"
    assert evals(trainer)[last_step]["eval_model_version"] == last_step


@pytest.mark.vllm
def test_step_evaluations_wait_for_eval_delay_steps(vllm_server, tiny_model_dir, tmp_path):
    args = make_config(
        vllm_server,
        tmp_path,
        max_steps=3,
        learning_rate=0.0,
        eval_strategy="steps",
        eval_steps=2,
        eval_delay=3,  # steps: step 2 is a multiple of eval_steps, but comes before it
        num_generations_eval=2,
        temperature_eval=0.0,
    )
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir),
        first_token_reward,
        args,
        train_dataset=rows(40, "train"),
        eval_dataset=rows(2, "eval"),
    )
    try:
        trainer.train()
    finally:
        restore_server(vllm_server.url, tiny_model_dir)
    # transformers also evaluates the last step of a "steps" run, once eval_delay has passed.
    assert sorted(evals(trainer)) == [3]


@pytest.mark.vllm
def test_evaluate_alone_gives_hand_counted_pass_at_k_per_named_dataset(vllm_server, tiny_model_dir, tmp_path):
    args = make_config(vllm_server, tmp_path, num_generations_eval=4, max_completion_length=4)
    counted = rows(4, "eval", passes=[0, 1, 2, 4])
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir),
        listed_passes,
        args,
        train_dataset=rows(4, "train", passes=[0] * 4),
        eval_dataset={"counted": counted, "none": rows(2, "eval", passes=[0, 0])},
    )
    figures = trainer.evaluate()
    assert figures["eval_counted_pass@1"] == pytest.approx((0 + 1 / 4 + 2 / 4 + 1) / 4)
    assert figures["eval_counted_pass@2"] == pytest.approx((0 + 1 / 2 + 5 / 6 + 1) / 4)
    assert figures["eval_counted_pass@4"] == pytest.approx(3 / 4)
    assert figures["eval_counted_reward"] == pytest.approx(7 / 16)
    assert figures["eval_none_pass@4"] == 0.0
    assert figures["eval_counted_samples_per_second"] > 0
    assert trainer.state.log_history[-1]["eval_counted_reward"] == pytest.approx(7 / 16)
    only = trainer.evaluate(eval_dataset=counted, metric_key_prefix="test")
    assert only["test_pass@4"] == pytest.approx(3 / 4)


def judge_down_for_one_prompt(completions, passes, **kwargs):
    if passes[0] < 0:
        raise ConnectionError("the judge answered 503 Service Unavailable")
    return listed_passes(completions, passes)


@pytest.mark.vllm
def test_an_eval_prompt_whose_reward_raised_is_left_unscored(vllm_server, tiny_model_dir, tmp_path, caplog):
    args = make_config(vllm_server, tmp_path, num_generations_eval=4, max_completion_length=4)
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir),
        judge_down_for_one_prompt,
        args,
        train_dataset=rows(4, "train", passes=[0] * 4),
        eval_dataset=rows(4, "eval", passes=[-1, 1, 2, 4]),
    )
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.rollout.reward_errors"):
        figures = trainer.evaluate()
    assert figures["eval_reward"] == pytest.approx((1 + 2 + 4) / 12), "the failed prompt left out"
    assert figures["eval_pass@4"] == pytest.approx(3 / 4), "an unscored prompt does not pass"
    assert "reward function 'judge_down_for_one_prompt' raised (eval dataset row 0)" in caplog.text


@pytest.mark.vllm
def test_a_resumed_run_keeps_the_schedule_and_the_best_checkpoint(vllm_server, tiny_model_dir, tmp_path):
    def run(max_steps: int, resume: str | None = None) -> AsyncGRPOTrainer:
        args = make_config(
            vllm_server,
            tmp_path,
            max_steps=max_steps,
            learning_rate=0.0,
            eval_strategy="steps",
            eval_steps=2,
            save_strategy="steps",
            save_steps=2,
            load_best_model_at_end=True,
            num_generations_eval=2,
            temperature_eval=0.0,
        )
        trainer = AsyncGRPOTrainer(
            str(tiny_model_dir),
            first_token_reward,
            args,
            train_dataset=rows(40, "train"),
            eval_dataset=rows(2, "eval"),
            # The head is negated after step 3: the evaluation at step 4 differs from step 2's.
            callbacks=[NegateHeadAtStep(3)],
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    try:
        first = run(2)
        resumed = run(4, str(Path(tmp_path) / "checkpoint-2"))
    finally:
        restore_server(vllm_server.url, tiny_model_dir)
    assert sorted(evals(first)) == [2]
    # Restored from the checkpoint: step 2's evaluation, then step 4's (not 3's).
    measured = evals(resumed)
    assert sorted(measured) == [2, 4]
    assert measured[4]["eval_reward"] != measured[2]["eval_reward"]
    # As _determine_best_metric: a later evaluation replaces the best only when higher.
    best_step = 4 if measured[4]["eval_reward"] > measured[2]["eval_reward"] else 2
    assert resumed.state.best_global_step == best_step
    assert resumed.state.best_model_checkpoint == str(Path(tmp_path) / f"checkpoint-{best_step}")
