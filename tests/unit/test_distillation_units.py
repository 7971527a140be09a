"""The distillation pipeline's pieces without a server: the teacher's answer parsed, samples carrying
it through packing and a checkpoint, and a packed row's distillation loss equal to the divergence of
each sample forwarded alone (plain HF forward, full softmax)."""

from __future__ import annotations

import asyncio
import copy
import json
import math

import pytest

pytest.importorskip(
    "datasets", reason="datasets is not installed (a GPU host may lack the non-torch dependencies)"
)
pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from aiohttp import web  # noqa: E402
from datasets import Dataset  # noqa: E402

from asyncgrpo import AsyncDistillationConfig, AsyncGRPOConfig  # noqa: E402
from asyncgrpo.cli.tiny_model import build_model, build_tokenizer  # noqa: E402
from asyncgrpo.generation.errors import VLLMUnavailableError  # noqa: E402
from asyncgrpo.generation.responses import MalformedResponseError, parse_prompt_logprobs  # noqa: E402
from asyncgrpo.losses.distillation import distillation_divergence, teacher_support  # noqa: E402
from asyncgrpo.packing.tree_attention import enable_tree_attention  # noqa: E402
from asyncgrpo.packing.trie import pack_row  # noqa: E402
from asyncgrpo.records.sample import Sample  # noqa: E402
from asyncgrpo.rollout.teacher import TeacherScoring, realized_teacher_logprobs, with_teacher_term  # noqa: E402
from asyncgrpo.trainer.distillation_loss import DistillationLoss  # noqa: E402
from asyncgrpo.trainer.held_samples import load_held_samples, save_held_samples  # noqa: E402
from asyncgrpo.trainer.teacher_check import check_teacher_ids  # noqa: E402

K = 4  # the teacher's report: top-3 plus the realized token


def test_the_teachers_answer_is_read_in_rank_order_at_the_asked_positions():
    reports = [
        None,  # the first token: nothing predicts it
        {"7": {"logprob": -0.5, "rank": 1}, "9": {"logprob": -1.5, "rank": 2}},
        {"3": {"logprob": -2.0, "rank": 5}, "4": {"logprob": -0.1, "rank": 1}, "8": {"logprob": None}},
    ]
    body = json.dumps({"choices": [{"text": "x", "prompt_logprobs": reports}]}).encode()
    ids, logprobs = parse_prompt_logprobs(body, np.array([1, 2, 0]), width=3)
    assert ids.tolist() == [[7, 9, -1], [4, 3, -1], [-1, -1, -1]]  # the NaN dropped, rank order kept
    assert logprobs[1].tolist()[:2] == [pytest.approx(-0.1), -2.0] and logprobs[2, 0] == -np.inf
    token_route = json.dumps({"request_id": "x", "choices": [], "prompt_logprobs": reports}).encode()
    assert parse_prompt_logprobs(token_route, np.array([1, 2, 0]), width=3)[0].tolist() == ids.tolist()
    with pytest.raises(MalformedResponseError, match="without prompt_logprobs"):
        parse_prompt_logprobs(b'{"choices": [{"text": "x"}]}', np.array([1]), 3)


def test_the_row_picks_its_teacher_by_its_teacher_id_column():
    scoring = TeacherScoring({"math": "http://a:1", "code": "http://b:2"}, 8, 1.0, 5.0, 5.0)
    assert scoring.teacher_of({"teacher_id": ["code"]}, row_index=0) == 1
    with pytest.raises(ValueError, match="teacher_id='poetry'.*math, code"):
        scoring.teacher_of({"teacher_id": ["poetry"]}, row_index=3)
    single = TeacherScoring({"default": "http://a:1"}, 8, 1.0, 5.0, 5.0)
    assert single.teacher_of({}, row_index=0) == 0


def teacher_report(rng, tokens: np.ndarray, trained: np.ndarray, vocab: int):
    """A made-up teacher's report at the trained tokens: 3 ranked ids, the realized token appended."""
    rows = int(trained.sum())
    ids = np.full((rows, K), -1, dtype=np.int64)
    logprobs = np.full((rows, K), -np.inf, dtype=np.float32)
    for row, token in enumerate(tokens[trained]):
        top = rng.choice(vocab, 3, replace=False)
        values = np.sort(np.log(rng.dirichlet(np.ones(5))[:3]))[::-1]
        ids[row, :3], logprobs[row, :3] = top, values
        if token not in top:
            ids[row, 3], logprobs[row, 3] = token, math.log(0.01)
    return ids, logprobs


@pytest.fixture(scope="module")
def models():
    plain = build_model(build_tokenizer())
    return plain, enable_tree_attention(copy.deepcopy(plain))


def samples_sharing_a_prompt(rng, vocab: int) -> list[Sample]:
    prompt = rng.integers(0, vocab, 9)
    samples = []
    for teacher, length in ((0, 6), (1, 4), (0, 7)):
        tokens = np.concatenate([prompt, rng.integers(0, vocab, length)])
        trained = np.arange(len(tokens)) >= len(prompt)
        ids, logprobs = teacher_report(rng, tokens, trained, vocab)
        sample = Sample(
            tokens, trained, np.zeros(length, np.float32), 0.0, 0,
            teacher_ids=ids, teacher_logprobs=logprobs, teacher_index=teacher,
        )  # fmt: skip
        sample.validate()
        samples.append(sample)
    return samples


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_a_packed_rows_loss_is_each_samples_divergence_forwarded_alone(models, tmp_path, beta):
    plain, tree = models
    vocab = plain.config.vocab_size
    samples = samples_sharing_a_prompt(np.random.default_rng(0), vocab)
    config = AsyncDistillationConfig(
        str(tmp_path),
        report_to="none",
        beta=beta,
        teacher_temperature=0.8,
        gradient_accumulation_steps=2,
        teacher_server_urls={"math": "http://a:1", "code": "http://b:2"},
    )
    row = pack_row(samples)
    assert row.num_tokens < sum(s.num_tokens for s in samples)  # the prompt is forwarded once
    entries = row.num_entries + 5.0  # the micro-batch holds other processes' entries too
    loss, metrics = DistillationLoss(config).row_loss(tree, row, entries, None, False, 0)

    expected, jsd, count, per_teacher = 0.0, 0.0, 0, {0: [0.0, 0], 1: [0.0, 0]}
    for sample in samples:
        with torch.no_grad():
            logits = plain(torch.from_numpy(sample.token_ids)[None]).logits[0].float()
        logp = torch.log_softmax(logits[:-1] / 0.8, -1)[torch.from_numpy(sample.trained[1:])]
        targets = torch.from_numpy(sample.token_ids[sample.trained])
        ids, teacher, valid = teacher_support(
            torch.from_numpy(sample.teacher_ids), torch.from_numpy(sample.teacher_logprobs), targets, beta
        )
        student = logp.gather(1, ids.clamp(min=0)).masked_fill(ids < 0, -math.inf)
        divergence = distillation_divergence(student, teacher, valid, beta)
        expected += divergence.jsd.sum().item()
        jsd += divergence.jsd.sum().item()
        count += int(divergence.scored.sum())
        per_teacher[sample.teacher_index][0] += divergence.jsd.sum().item()
        per_teacher[sample.teacher_index][1] += int(divergence.scored.sum())
    assert loss.item() == pytest.approx(expected / entries / 2, rel=1e-5)
    assert float(metrics["jsd"].value) / metrics["jsd"].weight == pytest.approx(jsd / count, rel=1e-5)
    assert metrics["jsd"].weight == count
    math_jsd = metrics["teacher_jsd/math"]
    assert float(math_jsd.value) / math_jsd.weight == pytest.approx(
        per_teacher[0][0] / per_teacher[0][1], rel=1e-5
    )
    frac = metrics["teacher_token_frac/code"]
    assert frac.value / frac.weight == pytest.approx(per_teacher[1][1] / count)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in tree.parameters() if p.grad is not None)
    tree.zero_grad()


def test_teacher_scores_survive_a_checkpoint(tmp_path):
    samples = samples_sharing_a_prompt(np.random.default_rng(1), 500)
    save_held_samples(samples, tmp_path)
    loaded = load_held_samples(tmp_path)
    for before, after in zip(samples, loaded):
        assert np.array_equal(before.teacher_ids, after.teacher_ids)
        assert np.array_equal(before.teacher_logprobs, after.teacher_logprobs)
        assert before.teacher_index == after.teacher_index


def test_a_row_without_teacher_scores_is_refused(models, tmp_path):
    _, tree = models
    sample = Sample(np.arange(6), np.arange(6) >= 3, np.zeros(3, np.float32), 0.0, 0)
    config = AsyncDistillationConfig(str(tmp_path), report_to="none")
    with pytest.raises(ValueError, match="without the teacher's scores"):
        DistillationLoss(config).row_loss(tree, pack_row([sample]), 3.0, None, False, 0)


def test_the_teacher_term_moves_each_tokens_advantage_by_the_teachers_view():
    """advantage + coef x (log q_teacher - log p_sampler) per trained token; a token the teacher did
    not score keeps the sample's advantage."""
    tokens = np.array([1, 2, 5, 6, 7])
    trained = np.array([False, False, True, True, True])
    sample = Sample(
        tokens, trained, np.log(np.array([0.5, 0.25, 0.1], np.float32)), 1.0, 0,
        teacher_ids=np.array([[5, 9], [3, 6], [-1, -1]]),
        teacher_logprobs=np.log(np.array([[0.8, 0.1], [0.6, 0.05], [0.0, 0.0]], np.float32)),
    )  # fmt: skip
    assert np.allclose(realized_teacher_logprobs(sample)[:2], np.log([0.8, 0.05]))
    assert np.isnan(realized_teacher_logprobs(sample)[2])
    taught = with_teacher_term(sample, coef=0.5)
    taught.validate()
    expected = [1.0 + 0.5 * math.log(0.8 / 0.5), 1.0 + 0.5 * math.log(0.05 / 0.25), 1.0]
    assert np.allclose(taught.token_advantages, expected, rtol=1e-5)
    row = pack_row([taught, sample])  # a sample without the term: its advantage on every token
    assert np.allclose(row.advantages, expected + [1.0, 1.0, 1.0], rtol=1e-5)


def test_grpo_takes_a_teacher_only_with_its_term(tmp_path):
    config = AsyncGRPOConfig(
        str(tmp_path), report_to="none", teacher_server_urls="http://t:1", teacher_kl_coef=0.1
    )
    assert config.teacher_server_urls == {"default": "http://t:1"}
    with pytest.raises(ValueError, match="teacher_server_urls without teacher_kl_coef > 0"):
        AsyncGRPOConfig(str(tmp_path), report_to="none", teacher_server_urls="http://t:1")
    with pytest.raises(ValueError, match="teacher_kl_coef=0.1 needs a teacher"):
        AsyncGRPOConfig(str(tmp_path), report_to="none", teacher_kl_coef=0.1)
    with pytest.raises(
        ValueError, match="AsyncDistillationConfig: teacher_kl_coef=0.1: the teacher term is GRPO's"
    ):
        AsyncDistillationConfig(str(tmp_path), report_to="none", teacher_kl_coef=0.1)


TEACHER_REPORT = {"7": {"logprob": -0.1, "rank": 1}, "8": {"logprob": -2.5, "rank": 2}}


class FakeTeacher:
    """A teacher's server on a loopback port that answers prompt_logprobs through /v1/completions after
    `failures` 503 answers; `stop` closes its port (connections are refused), `start` opens it again."""

    def __init__(self, failures: int = 0):
        self.failures, self.calls, self.port, self.runner = failures, [], 0, None

    async def handler(self, request: web.Request) -> web.Response:
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "teacher", "max_model_len": 64}]})
        if request.path == "/inference/v1/generate":  # a server without the token route
            return web.json_response({"detail": "Not Found"}, status=404)
        self.calls.append(request.path)
        if len(self.calls) <= self.failures:
            return web.json_response({"error": {"message": "teacher restarting"}}, status=503)
        return web.json_response(
            {"choices": [{"text": "", "prompt_logprobs": [None, TEACHER_REPORT, TEACHER_REPORT]}]}
        )

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handler)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        await self.runner.cleanup()


def teacher_sample() -> Sample:
    return Sample(np.array([1, 7, 8]), np.array([False, True, True]), np.zeros(2, np.float32), 0.0, 0)


def test_a_lone_teacher_lost_for_a_while_is_waited_for_and_one_lost_for_good_stops_the_run_naming_it():
    """Its groups wait while the only teacher's server fails and are scored when it answers again; a
    teacher that never answers stops the run after vllm_server_timeout, naming its URL and its error."""

    async def scenario(failures: int, timeout: float):
        server = FakeTeacher(failures)
        url = await server.start()
        scoring = TeacherScoring({"default": url}, 1, 1.0, timeout=timeout, request_timeout=timeout)
        try:
            await scoring.start()
            return (await scoring.score_group([teacher_sample()], 0))[0], len(server.calls)
        finally:
            await scoring.close()
            await server.stop()

    scored, calls = asyncio.run(scenario(failures=3, timeout=30.0))
    assert calls == 4 and scored.teacher_ids.tolist() == [[7, 8], [7, 8]]
    with pytest.raises(VLLMUnavailableError, match=r"no teacher answered .* at http://127\.0\.0\.1") as error:
        asyncio.run(scenario(failures=10**6, timeout=2.0))
    assert "teacher restarting" in str(error.value) and "'default'" in str(error.value)


def test_a_lost_teacher_s_groups_are_dropped_while_another_answers_and_it_is_used_again_when_back():
    """Two teachers (MOPD); "code" loses its server mid-run: its groups come back unscored (None, which
    the scheduler counts and drops) without waiting, "math" goes on scoring, and "code" scores again
    once its server is back (tried again each retry interval)."""

    async def scenario():
        math, code = FakeTeacher(), FakeTeacher()
        urls = {"math": await math.start(), "code": await code.start()}
        scoring = TeacherScoring(
            urls, 1, 1.0, timeout=60, request_timeout=60, patience=0.5, retry_interval=600
        )
        try:
            await scoring.start()
            assert (await scoring.score_group([teacher_sample()], 1)) is not None
            await code.stop()
            assert (
                await scoring.score_group([teacher_sample()], 1)
            ) is None  # lost: found out within patience
            attempts = scoring.clients[1].moved_count
            assert (
                await scoring.score_group([teacher_sample()], 1)
            ) is None  # dropped: not tried before 600 s
            assert scoring.clients[1].moved_count == attempts
            assert (await scoring.score_group([teacher_sample()], 0))[0].teacher_index == 0
            await code.start()  # the same port again
            scoring.retry_interval = 0.0
            back = await scoring.score_group([teacher_sample()], 1)
            assert back is not None and back[0].teacher_index == 1 and scoring.lost_since == [None, None]
        finally:
            await scoring.close()
            await math.stop()
            await code.stop()

    asyncio.run(scenario())


def test_rows_naming_an_unknown_teacher_are_refused_before_the_run():
    teachers = ["math", "code"]
    check_teacher_ids(Dataset.from_dict({"prompt": ["a", "b"], "teacher_id": ["math", "code"]}), teachers)
    with pytest.raises(ValueError, match=r"teachers that teacher_server_urls does not have: \['poetry'\]"):
        check_teacher_ids(
            Dataset.from_dict({"prompt": ["a", "b"], "teacher_id": ["math", "poetry"]}), teachers
        )
    with pytest.raises(ValueError, match="has no 'teacher_id' column"):
        check_teacher_ids(Dataset.from_dict({"prompt": ["a"]}), teachers)
    check_teacher_ids(Dataset.from_dict({"prompt": ["a"]}), ["default"])  # one teacher scores every row
