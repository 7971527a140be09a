"""The teachers of on-policy distillation, in the rollout process: a scoring step beside the reward
functions (docs/distillation.md, "The teacher's server").

Each teacher is a vLLM server that is never sent weights. A scored group's samples are sent to their
teacher token ids in, teacher-forced (`prompt_logprobs`: the teacher's top-k tokens at each position,
plus the realized one), and each sample leaves with the teacher's report at its trained tokens, which
the trainer's loss reads. With several teachers (MOPD) each dataset row's `teacher_id` column picks its
own; with one, it scores every row. A teacher that does not answer is waited for like a lone rollout
server: its requests are retried for up to vllm_server_timeout, then the run fails naming it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.generation.teacher_client import TeacherClient
from asyncgrpo.records.sample import Sample
from asyncgrpo.rollout.settings import ServerSettings, TeacherSettings

TEACHER_ID_COLUMN = "teacher_id"


class TeacherScoring:
    """One client per teacher id, in `teacher_server_urls`' order (a sample's `teacher_index`)."""

    def __init__(
        self, urls: dict[str, str], top_k: int, temperature: float, timeout: float, request_timeout: float
    ):
        self.teacher_ids = list(urls)
        self.top_k = top_k
        self.temperature = temperature
        self.clients = [
            TeacherClient(url, timeout=timeout, request_timeout=request_timeout) for url in urls.values()
        ]

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
            await client.wait_until_ready()
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

    async def score(self, samples: list[Sample], teacher: int) -> list[Sample]:
        """`samples` with teacher `teacher`'s report at their trained tokens, scored concurrently."""
        client = self.clients[teacher]

        async def one(sample: Sample) -> Sample:
            positions = np.flatnonzero(sample.trained)
            ids, logprobs = await client.prompt_logprobs(
                sample.token_ids.tolist(), positions, self.top_k, self.temperature
            )
            return dataclasses.replace(
                sample, teacher_ids=ids, teacher_logprobs=logprobs, teacher_index=teacher
            )

        return list(await asyncio.gather(*(one(sample) for sample in samples)))


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
