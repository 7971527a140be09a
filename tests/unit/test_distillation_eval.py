"""Evaluation with teachers, without a server: the teacher figures from given sampled and teacher
log-probs (hand-derived), no reward figures without a reward source, each eval completion's tokens
scored by its row's teacher at the right positions, and a teacher that fails discarding the
evaluation (a warning naming it) instead of stopping the run."""

from __future__ import annotations

import asyncio
import logging
import math
from types import SimpleNamespace

import pytest

pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

import numpy as np  # noqa: E402

from asyncgrpo import AsyncDistillationConfig  # noqa: E402
from asyncgrpo.errors import ConfigurationError  # noqa: E402
from asyncgrpo.generation.errors import VLLMUnavailableError  # noqa: E402
from asyncgrpo.rollout.eval_metrics import PromptOutcome, TeacherTokens, summarize, teacher_figures  # noqa: E402
from asyncgrpo.rollout.evaluation import EvalRunner, EvalTeacherFailed  # noqa: E402
from asyncgrpo.rollout.loop import AsyncRolloutLoop  # noqa: E402
from asyncgrpo.rollout.types import Rollout, TurnRecord  # noqa: E402
from asyncgrpo.trainer.evaluator import Evaluator, eval_config  # noqa: E402
from asyncgrpo.trainer.teacher_check import check_eval_teacher_ids  # noqa: E402

# -- the figures -----------------------------------------------------------------------------------------


def tokens(teacher_id: str, sampled: list[float], teacher: list[float]) -> TeacherTokens:
    return TeacherTokens(teacher_id, np.array(sampled, np.float32), np.array(teacher, np.float32))


def test_the_teacher_figures_are_per_token_means_over_the_tokens_it_scored():
    scored = [
        tokens("math", [-1.0, -2.0], [-1.5, -2.5]),  # sampled - teacher: 0.5, 0.5
        # 0.0; then a token the teacher reported nothing for (NaN), and one the server gave no
        # log-prob for (-inf): neither enters a mean.
        tokens("code", [-0.5, -0.25, -np.inf], [-0.5, np.nan, -1.0]),
    ]
    figures = teacher_figures(scored, per_teacher=True)
    assert figures["teacher_logprob"] == pytest.approx((-1.5 - 2.5 - 0.5) / 3)
    assert figures["teacher_kl"] == pytest.approx((0.5 + 0.5 + 0.0) / 3)
    assert figures["teacher_kl/math"] == pytest.approx(0.5)
    assert figures["teacher_kl/code"] == pytest.approx(0.0)
    # One teacher: no figure of its own; and a teacher likelier than the sampler gives a negative
    # one-sample estimate (it is a mean over few tokens, not the KL itself).
    alone = teacher_figures([tokens("default", [-2.0], [-0.5])], per_teacher=False)
    assert alone == {"teacher_logprob": -0.5, "teacher_kl": pytest.approx(-1.5)}
    nothing = teacher_figures([tokens("default", [-1.0], [np.nan])], per_teacher=False)
    assert math.isnan(nothing["teacher_kl"]) and math.isnan(nothing["teacher_logprob"])


def unrewarded(lengths: list[int], clipped: list[bool], teacher: TeacherTokens | None) -> PromptOutcome:
    """An outcome of a run without a reward source (distillation): no source, every reward NaN."""
    return PromptOutcome(np.full(len(lengths), np.nan), {}, lengths, clipped, teacher)


def test_an_evaluation_without_reward_sources_reports_no_reward_figures():
    outcomes = [
        unrewarded([3, 5], [False, True], tokens("default", [-1.0, -1.0], [-2.0, -1.0])),
        unrewarded([4, 4], [False, False], tokens("default", [-0.5], [-0.5])),
    ]
    figures = summarize(outcomes, threshold=1.0)
    assert figures == {
        "completions/mean_length": 4.0,
        "completions/clipped_ratio": 0.25,
        "teacher_logprob": pytest.approx((-2.0 - 1.0 - 0.5) / 3),
        "teacher_kl": pytest.approx((1.0 + 0.0 + 0.0) / 3),
    }
    # No teacher either: lengths alone.
    assert set(summarize([unrewarded([2], [False], None)], 1.0)) == {
        "completions/mean_length",
        "completions/clipped_ratio",
    }


def test_rewards_are_reported_when_any_source_scored_or_exists():
    # A Rollout.reward set by the loop is a source, though no function is named.
    from_rollouts = PromptOutcome(np.array([1.0, 0.0]), {}, [2, 2], [False, False])
    assert summarize([from_rollouts], 1.0)["pass@1"] == 0.5
    # A reward function that scored nothing still reports its (NaN) reward, as before.
    unscored = PromptOutcome(np.array([np.nan]), {"acc": [None]}, [2], [False])
    figures = summarize([unscored], 1.0)
    assert math.isnan(figures["reward"]) and math.isnan(figures["rewards/acc/mean"])


# -- the runner: each prompt's completion tokens scored by its row's teacher -------------------------------


class FakeTeacher:
    """Stands for a TeacherClient: a report per sequence (keyed by its token ids), or an error."""

    def __init__(self, reports: dict[tuple[int, ...], tuple[list, list]] | None = None, error=None):
        self.reports = reports or {}
        self.error = error
        self.asked: list[tuple[list[int], list[int], int, float]] = []

    async def prompt_logprobs(self, token_ids, positions, top_k, temperature):
        self.asked.append((token_ids, positions.tolist(), top_k, temperature))
        if self.error is not None:
            raise self.error
        ids, logprobs = self.reports[tuple(token_ids)]
        return np.array(ids, np.int64), np.array(logprobs, np.float32)

    async def close(self) -> None:
        pass


def runner_with(tmp_path, teachers: dict[str, FakeTeacher]) -> EvalRunner:
    urls = {teacher_id: f"http://teacher-{teacher_id}:1" for teacher_id in teachers}
    args = AsyncDistillationConfig(
        str(tmp_path), report_to="none", teacher_server_urls=urls, teacher_top_k=1, teacher_temperature=0.5
    )
    loop_kwargs = dict(
        config=eval_config(args), model_name="student", dataset=None, processing_class=None, eos_token_ids=[0]
    )
    runner = EvalRunner(AsyncRolloutLoop, loop_kwargs, client=None, reward_funcs=[], seed=0)
    runner.teachers.clients = list(teachers.values())
    return runner


def rollout(prompt: list[int], output: list[int], logprobs: list[float]) -> Rollout:
    return Rollout(completion=[], completion_ids=output, turns=[TurnRecord(prompt, output, logprobs)])


def test_each_completion_token_is_scored_by_the_rows_teacher(tmp_path):
    code = FakeTeacher(
        {
            # Report rows at the sampled positions 3 and 4: top-1 plus the realized token.
            (1, 2, 3, 7, 8): ([[5, 7], [8, -1]], [[-0.1, -1.2], [-0.3, -np.inf]]),
            (1, 2, 3, 9): ([[4, -1]], [[-0.2, -np.inf]]),  # the realized 9 not reported: NaN
        }
    )
    runner = runner_with(tmp_path, {"math": FakeTeacher(), "code": code})
    rollouts = [rollout([1, 2, 3], [7, 8], [-0.2, -0.5]), rollout([1, 2, 3], [9], [-1.0])]
    scored = asyncio.run(runner._teacher_tokens(rollouts, {"teacher_id": ["code", "code"]}, index=0))
    assert scored.teacher_id == "code" and runner.several_teachers
    assert scored.sampled.tolist() == pytest.approx([-0.2, -0.5, -1.0])
    assert scored.teacher[:2].tolist() == pytest.approx([-1.2, -0.3]) and np.isnan(scored.teacher[2])
    # At the teacher's temperature and top-k, only the sampled positions asked for.
    assert code.asked == [([1, 2, 3, 7, 8], [3, 4], 1, 0.5), ([1, 2, 3, 9], [3], 1, 0.5)]
    figures = teacher_figures([scored], per_teacher=True)
    assert figures["teacher_kl/code"] == pytest.approx(((-0.2 + 1.2) + (-0.5 + 0.3)) / 2)


def test_a_failing_teacher_fails_the_evaluation_naming_it_once_every_row_ran(tmp_path):
    lost = FakeTeacher(error=VLLMUnavailableError("vLLM server http://teacher-default:1 kept failing"))
    runner = runner_with(tmp_path, {"default": lost})

    async def prompt(index, row, slots):  # the rollouts sampled; the teacher step as _prompt runs it
        teacher = await runner._teacher_tokens([rollout([1], [2], [-0.1])], {}, index)
        return PromptOutcome(np.array([np.nan]), {}, [1], [False], teacher)

    runner._prompt = prompt
    runner.sampler = SimpleNamespace(labels_seen=set())
    with pytest.raises(EvalTeacherFailed, match="teacher 'default': vLLM server .* kept failing"):
        asyncio.run(runner.run([{"prompt": "a"}, {"prompt": "b"}], version=0))
    assert len(lost.asked) == 2  # every row ran to its end before the evaluation failed


class OneLabel:
    async def weight_labels(self) -> list[str]:
        return ["asyncgrpo-policy-0"]


class TeacherLost:
    """Stands for the EvalRunner of a run whose teacher failed."""

    several_teachers = False

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def run(self, rows, version):
        raise EvalTeacherFailed("a teacher did not score the eval completions (teacher 'math': gone)")


def test_an_evaluation_a_teacher_failed_on_is_discarded_with_a_warning(caplog):
    from asyncgrpo.generation.background import BackgroundLoop

    http = BackgroundLoop()
    try:
        evaluator = Evaluator(http, OneLabel(), TeacherLost(), pass_threshold=1.0)
        evaluator.start({"eval": [{}]}, step=4, version=0)
        with caplog.at_level(logging.WARNING):
            assert evaluator.join() is None  # nothing logged, and the run goes on
        evaluator.close()
    finally:
        http.close()
    assert "the evaluation of step 4 is discarded" in caplog.text and "teacher 'math'" in caplog.text


# -- settings checked before a run ---------------------------------------------------------------------


def test_with_several_teachers_every_eval_row_names_one():
    check_eval_teacher_ids([{"prompt": "a"}], ["default"], "eval")  # one teacher scores every row
    check_eval_teacher_ids([{"teacher_id": "math"}, {"teacher_id": "code"}], ["math", "code"], "eval")
    with pytest.raises(ConfigurationError, match="eval dataset 'eval_hard', row 1: teacher_id='physics'"):
        check_eval_teacher_ids(
            [{"teacher_id": "math"}, {"teacher_id": "physics"}], ["math", "code"], "eval_hard"
        )


def test_the_best_distilled_model_is_the_one_closest_to_its_teachers(tmp_path):
    best = AsyncDistillationConfig(
        str(tmp_path),
        report_to="none",
        max_steps=4,
        eval_strategy="steps",
        eval_steps=2,
        save_steps=2,
        load_best_model_at_end=True,
    )
    assert (best.metric_for_best_model, best.greater_is_better) == ("teacher_kl", False)
    with pytest.raises(ConfigurationError, match="metric_for_best_model='eval_reward': a distillation run"):
        AsyncDistillationConfig(str(tmp_path), report_to="none", metric_for_best_model="eval_reward")
