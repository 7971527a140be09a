"""The teachers of on-policy distillation, in the rollout process: a scoring step beside the reward
functions (docs/distillation.md, "The teacher's server").

Each teacher is a vLLM server that is never sent weights. A scored group's samples are sent to their
teacher token ids in, teacher-forced (`prompt_logprobs`: the teacher's top-k tokens at each position,
plus the realized one), and each sample leaves with the teacher's report at its trained tokens, which
the trainer's loss reads. With several teachers (MOPD) each dataset row's `teacher_id` column picks its
own; with one, it scores every row.

A teacher that stops answering is handled as a lost rollout server is (docs/distillation.md, "A teacher
that is lost"). While another teacher still answers, the lost one's groups are dropped and counted, and
it is tried again now and then: the others carry the run. While no teacher answers, each group waits
for its own; after vllm_server_timeout without any, the run stops, naming them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import numpy as np

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.generation.errors import VLLMUnavailableError
from asyncgrpo.generation.teacher_client import TeacherClient
from asyncgrpo.records.sample import Sample
from asyncgrpo.rollout.settings import ServerSettings, TeacherSettings

logger = logging.getLogger(__name__)

TEACHER_ID_COLUMN = "teacher_id"
# How long one scoring attempt waits out a teacher that refuses or drops its connections before the
# teacher counts as lost: long enough for a dropped connection, short against a restart (which a group
# waits out by trying again while no other teacher answers).
TEACHER_PATIENCE_S = 10.0
# A lost teacher is tried again at most this often; in between, its groups are dropped at once while
# another teacher answers (trying it for each would hold every one of them for TEACHER_PATIENCE_S).
TEACHER_RETRY_INTERVAL_S = 5.0


class TeacherScoring:
    """One client per teacher id, in `teacher_server_urls`' order (a sample's `teacher_index`)."""

    def __init__(
        self,
        urls: dict[str, str],
        top_k: int,
        temperature: float,
        timeout: float,
        request_timeout: float,
        patience: float = TEACHER_PATIENCE_S,
        retry_interval: float = TEACHER_RETRY_INTERVAL_S,
    ):
        # `timeout`: how long the run waits for a teacher, at the start and while none answers.
        self.teacher_ids = list(urls)
        self.top_k = top_k
        self.temperature = temperature
        self.timeout = timeout
        self.retry_interval = retry_interval
        self.clients = [
            TeacherClient(url, timeout=min(patience, timeout), request_timeout=request_timeout)
            for url in urls.values()
        ]
        self.lost_since: list[float | None] = [None] * len(self.clients)  # None: it answers
        self.last_try = [float("-inf")] * len(self.clients)
        self.last_error = [""] * len(self.clients)

    @classmethod
    def of(cls, teachers: TeacherSettings | None, servers: ServerSettings) -> TeacherScoring | None:
        """The run's teachers; None for a run without any (GRPO)."""
        if teachers is None:
            return None
        return cls(
            teachers.urls, teachers.top_k, teachers.temperature, servers.timeout, servers.request_timeout
        )

    async def start(self) -> None:
        """Wait until every teacher answers, and ask which model each serves (its requests name it)."""
        for client in self.clients:
            await client.wait_until_ready(self.timeout)
            await client.model_name()

    async def close(self) -> None:
        await asyncio.gather(*(client.close() for client in self.clients))

    def teacher_of(self, columns: dict[str, list[Any]], row_index: int) -> int:
        """The index of the teacher that scores a row, from its `teacher_id` column (MOPD)."""
        if len(self.teacher_ids) == 1:
            return 0
        chosen = columns.get(TEACHER_ID_COLUMN, [None])[0]
        if chosen not in self.teacher_ids:
            raise ConfigurationError(
                f"dataset row {row_index} has teacher_id={chosen!r}, which is not a teacher of "
                f"teacher_server_urls ({', '.join(self.teacher_ids)}): with several teachers every row "
                f"names its own in a {TEACHER_ID_COLUMN!r} column"
            )
        return self.teacher_ids.index(chosen)

    async def score_group(self, samples: list[Sample], teacher: int) -> list[Sample] | None:
        """A group's `samples` scored by teacher `teacher`, or None when that teacher is lost while
        another one answers: the group is dropped (the caller counts it). While no teacher answers, the
        group waits for its own, until `timeout` has passed since the last one was lost; then it raises
        VLLMUnavailableError naming every teacher."""
        while True:
            if self._worth_trying(teacher):
                self.last_try[teacher] = time.monotonic()
                client = self.clients[teacher]
                client.servers.try_again(client.base_urls[0])
                try:
                    scored = await self.score(samples, teacher)
                except VLLMUnavailableError as error:
                    self._lost(teacher, error)
                else:
                    self._answers(teacher)
                    return scored
            if any(since is None for since in self.lost_since):
                return None
            waited = time.monotonic() - max(self.lost_since)
            if waited > self.timeout:
                raise VLLMUnavailableError(
                    f"no teacher answered for {waited:.0f} s (vllm_server_timeout={self.timeout:g}): "
                    + "; ".join(self._describe(index) for index in range(len(self.clients)))
                    + ". Restart the teachers' servers (asyncgrpo serve --for CONFIG --teacher ID) and "
                    "resume from the last checkpoint"
                )
            await asyncio.sleep(self.retry_interval / 5)

    async def score(self, samples: list[Sample], teacher: int) -> list[Sample]:
        """`samples` with teacher `teacher`'s report at their trained tokens, scored concurrently; the
        first failure cancels the other requests and is raised."""
        client = self.clients[teacher]

        async def one(sample: Sample) -> Sample:
            positions = np.flatnonzero(sample.trained)
            ids, logprobs = await client.prompt_logprobs(
                sample.token_ids.tolist(), positions, self.top_k, self.temperature
            )
            return dataclasses.replace(
                sample, teacher_ids=ids, teacher_logprobs=logprobs, teacher_index=teacher
            )

        requests = [asyncio.ensure_future(one(sample)) for sample in samples]
        try:
            return list(await asyncio.gather(*requests))
        finally:
            for request in requests:  # after a failure: the others would wait out the lost teacher too
                request.cancel()

    def _worth_trying(self, teacher: int) -> bool:
        """A teacher that answers always is; a lost one once per retry interval (one group tries it)."""
        since_last = time.monotonic() - self.last_try[teacher]
        return self.lost_since[teacher] is None or since_last >= self.retry_interval

    def _lost(self, teacher: int, error: Exception) -> None:
        self.last_try[teacher] = time.monotonic()  # the retry interval counts from the failure
        self.last_error[teacher] = str(error)
        if self.lost_since[teacher] is None:
            self.lost_since[teacher] = time.monotonic()
            others = any(since is None for since in self.lost_since)
            logger.warning(
                "teacher %r at %s is lost (%s); %s",
                self.teacher_ids[teacher],
                self.clients[teacher].base_urls[0],
                error,
                "its groups are dropped and counted (rollout/teacher_lost_groups) while the other "
                "teachers carry the run"
                if others
                else "the run waits for a teacher to answer again",
            )

    def _answers(self, teacher: int) -> None:
        if self.lost_since[teacher] is not None:
            self.lost_since[teacher] = None
            logger.warning("teacher %r answers again", self.teacher_ids[teacher])

    def _describe(self, teacher: int) -> str:
        url = self.clients[teacher].base_urls[0]
        return f"teacher {self.teacher_ids[teacher]!r} at {url} ({self.last_error[teacher]})"


def realized_teacher_logprobs(sample: Sample) -> np.ndarray:
    """(T,) the teacher's log-prob of each trained token as it reported it; NaN where it did not (its
    report holds the realized token at any rank, so only a position it scored nothing at lacks it)."""
    targets = sample.token_ids[sample.trained]
    found = sample.teacher_ids == targets[:, None]
    values = np.where(found, sample.teacher_logprobs, -np.inf).max(axis=1)
    return np.where(found.any(axis=1), values, np.nan).astype(np.float32)


def with_teacher_term(sample: Sample, coef: float) -> Sample:
    """GRPO with a teacher: each trained token's advantage is the sample's plus coef x (log q_teacher -
    log p_sampler) of the token, a one-sample estimate of the per-token reverse KL to the teacher
    (negated: tokens the teacher finds likelier than the sampler did are pushed up). A token the teacher
    did not score keeps the sample's advantage."""
    term = realized_teacher_logprobs(sample) - sample.sampler_logprobs
    term = np.where(np.isnan(term), 0.0, term)
    return dataclasses.replace(sample, token_advantages=(sample.advantage + coef * term).astype(np.float32))


def with_teacher_terms(samples: list[Sample], coef: float) -> tuple[list[Sample], np.ndarray]:
    """A group's samples with the teacher term in their tokens' advantages, and the gaps
    log p_sampler - log q of every token the teacher scored (their mean is the logged `teacher_kl`)."""
    gaps = np.concatenate([sample.sampler_logprobs - realized_teacher_logprobs(sample) for sample in samples])
    return [with_teacher_term(sample, coef) for sample in samples], gaps[~np.isnan(gaps)]
