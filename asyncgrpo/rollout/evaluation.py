"""EvalRunner: held-out prompts sampled on the vLLM servers and scored, outside the training stream.

It runs in the trainer's process, on the trainer's HTTP event loop, and shares nothing with the
rollout worker: eval prompts never enter the prompt stream, the staleness budget, the intake or the
resume state. Rollouts come from the run's own rollout loop class (its `generate_one`, so tools,
environments and custom loops behave as in training) with the eval settings in its config
(`num_generations_eval`, `temperature_eval`), and are scored by the run's reward functions, summed
as in training. With teachers (`teacher_server_urls`: distillation, or GRPO's teacher term) each
prompt's completion tokens are also scored by the prompt's teacher, as training's scoring step picks
it, beside the log-probs the policy's server sampled them with (rollout/eval_metrics.py turns both
into the teacher figures). The weights that sampled each response are recorded from the servers'
labels, so the trainer can refuse an evaluation that saw more than one policy (docs/architecture.md,
"Evaluation").
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from asyncgrpo.errors import ServerError
from asyncgrpo.generation.client import VLLMClient
from asyncgrpo.records.sample import Sample
from asyncgrpo.rollout.advantages import is_truncated, source_weights
from asyncgrpo.rollout.context import LoopInputs, hook_context
from asyncgrpo.rollout.environments import EnvironmentPool
from asyncgrpo.rollout.eval_metrics import PromptOutcome, TeacherTokens
from asyncgrpo.rollout.prompts import CURRENT_ROW
from asyncgrpo.rollout.reward_errors import RewardErrorBudget
from asyncgrpo.rollout.sampler import PolicySampler
from asyncgrpo.rollout.scoring import (
    call_reward_functions,
    checked_extra_sources,
    reward_function_name,
    sum_rewards,
)
from asyncgrpo.rollout.sequences import build_training_sequences
from asyncgrpo.rollout.teacher import TeacherScoring, realized_teacher_logprobs
from asyncgrpo.rollout.types import Rollout, TrainingSequence

if TYPE_CHECKING:
    from asyncgrpo.rollout.loop import AsyncRolloutLoop


class EvalSampler(PolicySampler):
    """A PolicySampler that records the weight labels the servers report instead of requiring the
    trainer's: before train() the servers run their own checkpoint, under vLLM's label."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.labels_seen: set[str] = set()

    def sampled_version(self, weight_labels: tuple[str, ...], version: int, url: str | None = None) -> int:
        self.labels_seen.update(weight_labels)
        return version


class EvalTeacherFailed(ServerError):
    """A teacher did not score an evaluation's tokens (it stayed unreachable for vllm_server_timeout,
    or refused the request): the evaluation is discarded, training goes on."""


class EvalRunner:
    """Open once (`open`, on the event loop that runs it), `run` any number of evaluations, `close`."""

    def __init__(
        self,
        loop_cls,
        loop_kwargs: dict[str, Any],
        client: VLLMClient,
        reward_funcs: list[Callable],
        seed: int,
    ):
        # `loop_kwargs`: LoopInputs.of's arguments, its config with the eval settings already applied
        # (trainer/evaluator.py).
        self.loop_cls = loop_cls
        self.inputs = LoopInputs.of(**loop_kwargs)
        self.settings = self.inputs.settings
        self.loop: AsyncRolloutLoop | None = None  # built by open(), once the servers answer
        self.client = client
        self.reward_funcs = list(reward_funcs)
        self.seed = seed
        self.version = SimpleNamespace(value=0)  # the policy version requests are labelled with
        size = self.settings.scheduling.max_concurrent_rollouts
        # Tools and reward functions get pools of their own, as in the rollout worker: a slow judge must
        # not take the threads the tools of running rollouts wait for.
        self._tool_executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="eval-tool")
        self._reward_executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="eval-reward")
        self.environments: EnvironmentPool | None = None
        self.sampler: EvalSampler | None = None
        # A reward function that raises on an eval prompt leaves that prompt unscored by it, under the
        # training's policy (rollout/reward_errors.py), counted over the eval prompts.
        scoring = self.settings.scoring
        self._reward_errors = RewardErrorBudget(scoring.reward_error_tolerance, scoring.reward_error_window)
        # The run's teachers (None without any), with clients of their own: the rollout worker's live in
        # its process. A teacher's failures in one run: {teacher id: the first error}.
        self.teachers = TeacherScoring.of(self.settings.teachers, self.settings.servers)
        self._teacher_failures: dict[str, str] = {}

    @property
    def several_teachers(self) -> bool:
        """Whether the run has more than one teacher (each then gets figures of its own)."""
        return self.teachers is not None and len(self.teachers.teacher_ids) > 1

    async def open(self) -> None:
        # Token ids in and out where the server offers it: that route also reports which weights
        # sampled each token. No candidate sets: nothing here is trained on.
        token_route = await self.client.supports_token_generate()
        inputs = self.inputs
        self.sampler = EvalSampler(
            self.client, self.version, inputs.lora_name, self.seed, token_route, candidate_sets=False
        )
        max_model_len = await self.client.max_model_len()
        context = hook_context(inputs, self.client, self.sampler, max_model_len, self._tool_executor)
        self.loop = loop = self.loop_cls(inputs, context)
        if inputs.environment_factory is not None:
            self.environments = EnvironmentPool(
                inputs.environment_factory, self._tool_executor, lambda: loop.metrics
            )
        await loop.setup()

    async def run(self, rows: list[dict[str, Any]], version: int) -> tuple[list[PromptOutcome], set[str]]:
        """Every row's `num_generations_eval` rollouts, scored: (one outcome per row, the weight
        labels the servers reported for the sampled tokens). EvalTeacherFailed, naming the teacher,
        when a teacher failed on any row: raised once every row has finished, so that nothing of this
        evaluation still runs against the servers when the trainer goes on (a weight sync)."""
        self.version.value = version
        self.sampler.labels_seen = set()
        self._teacher_failures = {}
        slots = asyncio.Semaphore(self.settings.scheduling.max_concurrent_rollouts)
        outcomes = await asyncio.gather(*(self._prompt(index, row, slots) for index, row in enumerate(rows)))
        if self._teacher_failures:
            failures = "; ".join(f"teacher {tid!r}: {error}" for tid, error in self._teacher_failures.items())
            raise EvalTeacherFailed(f"a teacher did not score the eval completions ({failures})")
        return list(outcomes), set(self.sampler.labels_seen)

    async def close(self) -> None:
        try:
            if self.loop is not None:
                await self.loop.close()
        finally:
            self._tool_executor.shutdown(wait=False, cancel_futures=True)
            self._reward_executor.shutdown(wait=False, cancel_futures=True)
            if self.teachers is not None:
                await self.teachers.close()

    async def _prompt(self, index: int, row: dict[str, Any], slots: asyncio.Semaphore) -> PromptOutcome:
        if "prompt" not in row and self.environments is None:
            raise KeyError(f"eval dataset row {index} has no 'prompt' column")
        size = self.settings.scheduling.num_generations
        group_id = -1 - index  # apart from any training group id, for the loop's rendered-prompt cache
        results = await asyncio.gather(*(self._rollout(row, group_id, slots) for _ in range(size)))
        self.loop.context.renders.forget(group_id)
        rollouts = [rollout for rollout, _, _ in results]
        columns = {key: [value] * size for key, value in row.items() if key != "prompt"}
        per_function = await call_reward_functions(
            self.reward_funcs,
            self._reward_executor,
            [prompt for _, prompt, _ in results],
            [rollout.completion for rollout in rollouts],
            [rollout.completion_ids for rollout in rollouts],
            columns,
            timeout_s=self.settings.scoring.reward_timeout,
            where=f" (eval dataset row {index})",
            catch_errors=self._reward_errors.catches,
        )
        if self._reward_errors.group_failed(per_function, f" (eval dataset row {index})"):
            per_function = [[None] * size for _ in per_function]
        env_names, env_sources, rollout_rewards = checked_extra_sources(
            [env_reward for *_, env_reward in results], [rollout.reward for rollout in rollouts]
        )
        sources = [*per_function, *env_sources]
        names = [reward_function_name(function) for function in self.reward_funcs] + env_names
        eos = set(self.loop.eos_token_ids)
        weights = source_weights(self.settings.scoring.reward_weights, len(per_function), len(sources) + 1)
        return PromptOutcome(
            rewards=sum_rewards([*sources, rollout_rewards], size, weights),  # as training weighs them
            per_source=dict(zip(names, sources)),
            lengths=[sum(len(turn.output_ids) for turn in rollout.turns) for rollout in rollouts],
            clipped=[is_truncated(rollout, eos) for rollout in rollouts],
            teacher=None if self.teachers is None else await self._teacher_tokens(rollouts, columns, index),
        )

    async def _teacher_tokens(
        self, rollouts: list[Rollout], columns: dict[str, list], index: int
    ) -> TeacherTokens | None:
        """The prompt's completion tokens (those training would train on) scored by its teacher, the
        one training's scoring step would pick; None when the teacher failed (recorded, `run` raises)."""
        teachers = self.teachers
        teacher = teachers.teacher_of(columns, index)
        teacher_id = teachers.teacher_ids[teacher]
        samples = [
            completion_sample(sequence, index)
            for rollout in rollouts
            for sequence in build_training_sequences(rollout.turns)[0]
        ]
        try:
            scored = await teachers.score(samples, teacher)
        except ServerError as error:
            self._teacher_failures.setdefault(teacher_id, f"{error} (eval dataset row {index})")
            return None
        none = np.zeros(0, dtype=np.float32)  # rollouts that sampled no token the teacher could score
        return TeacherTokens(
            teacher_id,
            sampled=np.concatenate([none] + [sample.sampler_logprobs for sample in scored]),
            teacher=np.concatenate([none] + [realized_teacher_logprobs(sample) for sample in scored]),
        )

    async def _rollout(self, row: dict[str, Any], group_id: int, slots: asyncio.Semaphore):
        """(the rollout, its prompt, its environment's reward or None), as the rollout worker makes it."""
        loop = self.loop
        CURRENT_ROW.set(row)  # this rollout's task only: gather runs each in a context of its own
        async with slots:
            if self.environments is None:
                return await loop.generate_one(row["prompt"], loop.tools, group_id), row["prompt"], None
            async with self.environments.episode(row) as episode:
                rollout = await loop.generate_one(episode.prompt, loop.tools + episode.tools, group_id)
                return rollout, episode.prompt, await self.environments.reward(episode.instance)


def completion_sample(sequence: TrainingSequence, row_index: int) -> Sample:
    """A sequence as the sample a teacher scores: its tokens, which of them the policy sampled, and
    the log-probs it sampled them with. Nothing trains on it (no advantage, no group)."""
    return Sample(
        token_ids=sequence.token_ids,
        trained=sequence.trained,
        sampler_logprobs=sequence.sampler_logprobs,
        advantage=0.0,
        group_id=-1,
        row_index=row_index,
    )
