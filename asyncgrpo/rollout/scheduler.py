"""RolloutScheduler: runs a user's AsyncRolloutLoop in the rollout process.

It owns everything a hook must not touch: the prompt stream, the staleness budget (token
allowance), the concurrency cap and its load polling, the scoring queue and scorers, the heartbeat,
the metric flushes and the failure of any task. The rollout process (rollout/worker.py) builds it;
once the servers answer it builds the user's loop with what the hooks may read (rollout/context.py)
and calls the hooks. Order of events and timing: docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncgrpo.errors import ContractError, RewardError, RolloutError
from asyncgrpo.generation.client import ServerLostError, VLLMClient
from asyncgrpo.records.metrics import MetricsWindow, Reduce, Stat
from asyncgrpo.rollout.advantages import advantage_basis, is_truncated, source_weights
from asyncgrpo.rollout.agent import record_tool_rollout_metrics
from asyncgrpo.rollout.channels import WorkerChannels
from asyncgrpo.rollout.chat import RewriteDetector
from asyncgrpo.rollout.concurrency import TokenAllowance
from asyncgrpo.rollout.context import LoopInputs, hook_context
from asyncgrpo.rollout.environments import EnvironmentPool
from asyncgrpo.rollout.idle_clock import IdleClock
from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.rollout.prompts import CURRENT_ROW, PromptItem, StreamStart, prompt_stream
from asyncgrpo.rollout.reward_errors import RewardErrorBudget
from asyncgrpo.rollout.rollout_metrics import record_group_metrics, record_rollout_metrics
from asyncgrpo.rollout.sampler import PolicySampler, wants_candidate_sets
from asyncgrpo.rollout.scoring import (
    call_reward_functions,
    checked_extra_sources,
    is_degenerate_group,
    reward_function_name,
    sum_rewards,
    training_samples,
)
from asyncgrpo.rollout.sequences import build_training_sequences
from asyncgrpo.rollout.server_share import ServerShare, initial_servers
from asyncgrpo.rollout.teacher import TeacherScoring, with_teacher_terms
from asyncgrpo.rollout.types import Rollout, RolloutGroup
from asyncgrpo.rollout.worker_shares import owns_stream_index, share_of_range
from asyncgrpo.run import timeline

if TYPE_CHECKING:
    from asyncgrpo.rollout.loop import AsyncRolloutLoop

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
# How often a worker that is ready checks whether the trainer lets it generate: small against the
# start-up it follows (seconds), cheap for an event loop with nothing else to do.
START_POLL_INTERVAL_S = 0.01
METRICS_FLUSH_INTERVAL_S = 1.0
# Groups scored at once. Scoring is mostly waiting (threads, async judges, the event loop running
# generation callbacks between them), so many groups in flight keep it off the critical path.
SCORE_CONCURRENCY = 64
# What the user's close() hook may take when the loop stops, before the process leaves without it.
CLOSE_HOOK_TIMEOUT_S = 30.0
# Beyond reward_timeout, how long a full scoring queue may stand still before scoring counts as stuck.
SCORE_QUEUE_GRACE_S = 60.0
# Generated groups waiting for a scorer; past this many, a finished group waits to be queued.
SCORE_QUEUE_MAXSIZE = 16
# How many vllm_server_timeouts the trainer may leave the staleness budget unmoved before it counts as stuck.
ALLOWANCE_STALL_FACTOR = 4


class RolloutScheduler:
    """Runs one rollout process: builds the user's loop (`loop_cls`) once the servers answer, and
    drives its hooks until cancelled or until something fails."""

    def __init__(self, loop_cls, inputs: LoopInputs, channels: WorkerChannels, stream: StreamStart):
        self.loop_cls = loop_cls
        self.inputs = inputs
        self.settings = settings = inputs.settings
        self.scoring = settings.scoring
        self.channels = channels
        self.stream = stream
        self.loop: AsyncRolloutLoop | None = None  # built in _main, once the servers answer
        self.environments: EnvironmentPool | None = None  # made in _main, with the tool thread pool
        self._rewrites = RewriteDetector()
        self._reward_errors = RewardErrorBudget(
            self.scoring.reward_error_tolerance, self.scoring.reward_error_window
        )
        self._tasks: set[asyncio.Task] = set()
        # The worker's side of the run's timeline, sent to the trainer with each metrics flush.
        self._timeline = timeline.EventBuffer()
        self._request_lanes = timeline.Lanes("request")

    def _make_thread_pools(self) -> None:
        """Sync tools and environments get max_concurrent_rollouts threads, one per running rollout,
        so a tool call never waits for a thread. Sync reward functions get their own pool: groups
        scored at once (up to SCORE_CONCURRENCY) with a slow judge must not take the tools' threads."""
        size = self.settings.scheduling.max_concurrent_rollouts
        self.tool_executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="tool")
        self._reward_executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="reward")

    # -- the process's main -------------------------------------------------------------------------------

    def run(self) -> None:
        """Run until cancelled (SIGTERM from the trainer) or until something fails."""
        asyncio.run(self._main())

    async def _main(self) -> None:
        inputs, channels = self.inputs, self.channels
        # The trainer stops the worker with SIGTERM: unwind through the finally below (close() runs).
        # Only the first SIGTERM counts: another one must not interrupt the clean-up it started.
        main_task = asyncio.current_task()
        asyncio.get_running_loop().add_signal_handler(
            signal.SIGTERM, lambda: None if main_task.cancelling() else main_task.cancel()
        )
        self._timeline.process = timeline.worker_process(channels.worker_index, channels.num_workers)
        timeline.activate(self._timeline)
        self._make_thread_pools()
        if inputs.environment_factory is not None:
            self.environments = EnvironmentPool(
                inputs.environment_factory, self.tool_executor, lambda: self.loop.metrics
            )
        # Distillation: the teachers score each group's samples beside the reward functions.
        self.teachers = TeacherScoring.of(self.settings.teachers, self.settings.servers)
        servers = self.settings.servers
        self.client = VLLMClient(
            initial_servers(channels, servers.urls),
            timeout=servers.timeout,
            model=inputs.model_name,
            request_timeout=servers.request_timeout,
        )
        try:
            await self._build_loop()
            if self.teachers is not None:
                await self.teachers.start()
            await self.loop.setup()
            await self._start_state()
            self.channels.ready_event.set()
            self._fatal: asyncio.Future = asyncio.get_running_loop().create_future()
            self._watch(asyncio.create_task(self._heartbeat_loop()))
            with timeline.span("wait for the starting weights", lane="generate loop"):
                while not self.channels.start_event.is_set():
                    await asyncio.sleep(START_POLL_INTERVAL_S)
            loops = [
                self._generate_loop(),
                self.share.load_loop(self.loop.load_poll_interval_s),
                self.share.servers_loop(),
                self._metrics_loop(),
                *(self._score_loop(index) for index in range(SCORE_CONCURRENCY)),
            ]
            for coroutine in loops:
                self._watch(asyncio.create_task(coroutine))
            await self._fatal
        finally:
            await self._stop()

    async def _build_loop(self) -> None:
        """Once the servers answer: the sampler, the hook context and the user's loop."""
        await self.client.wait_until_ready()
        self.max_model_len = await self.client.max_model_len()
        sampling = self.settings.sampling
        candidate_sets = await wants_candidate_sets(self.client, sampling)
        # Token in, token out wherever the server offers it: the same samples, far less work
        # for the server's API process than `/v1/completions`, which detokenizes every top
        # log-prob (bench/RESULTS.md, "overlap").
        token_route = candidate_sets or await self.client.supports_token_generate()
        sampler = PolicySampler(
            self.client,
            self.channels.model_version_value,
            self.inputs.lora_name,
            seed=sampling.seed,
            token_route=token_route,
            candidate_sets=candidate_sets,
            routing_replay=sampling.moe_routing_replay,
        )
        context = hook_context(self.inputs, self.client, sampler, self.max_model_len, self.tool_executor)
        self.loop = self.loop_cls(self.inputs, context)

    async def _stop(self) -> None:
        """Cancel every task, give the loop's close() its time, then release the servers' clients
        and the thread pools."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            if self.loop is not None:
                await asyncio.wait_for(self.loop.close(), CLOSE_HOOK_TIMEOUT_S)
        except asyncio.TimeoutError:
            logger.warning(
                "the rollout loop's close() did not finish within %.0f s; leaving without it",
                CLOSE_HOOK_TIMEOUT_S,
            )
        finally:
            timeline.activate(None)
            await self.client.close()
            if self.teachers is not None:
                await self.teachers.close()
            self.tool_executor.shutdown(wait=False, cancel_futures=True)
            self._reward_executor.shutdown(wait=False, cancel_futures=True)

    async def _start_state(self) -> None:
        scheduling = self.settings.scheduling
        self.allowance = TokenAllowance(scheduling.num_generations)
        self.share = ServerShare(
            self.client,
            self.channels,
            scheduling.max_concurrent_rollouts,
            stall_timeout_s=self.settings.servers.timeout,
            metrics=lambda: self.loop.metrics,
            describe_waits=self.loop.context.activity.describe,
        )
        await self.share.start(self.max_model_len)
        self.slots = self.share.slots
        self.score_queue: asyncio.Queue = asyncio.Queue(maxsize=SCORE_QUEUE_MAXSIZE)
        self._generated_tokens = 0
        self._last_flush = time.monotonic()
        self._reported_retries = self._reported_moves = 0
        self._next_group_id = self.channels.worker_index  # then every num_workers-th (worker_shares.py)
        self._warned_skip = False
        self._idle = IdleClock(time.monotonic())

    def _fail(self, error: BaseException) -> None:
        if not self._fatal.done():
            self._fatal.set_exception(error)

    def _watch(self, task: asyncio.Task) -> None:
        def done(finished: asyncio.Task) -> None:
            self._tasks.discard(finished)
            if not finished.cancelled() and finished.exception() is not None:
                self._fail(finished.exception())

        self._tasks.add(task)
        task.add_done_callback(done)

    # -- generation ---------------------------------------------------------------------------------------

    async def _generate_loop(self) -> None:
        dataset = self.inputs.dataset
        rejected_in_epoch: dict[int, int] = {}
        order = self.settings.scheduling.prompt_order  # data_seed (or seed) and train_sampling_strategy
        stream = prompt_stream(dataset, order.seed, self.stream.first_index, self.stream.skip)
        num_rows = len(dataset) if hasattr(dataset, "__len__") else None
        worker, num_workers = self.channels.worker_index, self.channels.num_workers
        for item in stream:
            if not owns_stream_index(item.stream_index, worker, num_workers):
                continue  # another rollout worker's prompt
            if not self.loop.filter_prompt(item.row_index, item.row, item.epoch):
                rejected_in_epoch[item.epoch] = rejected_in_epoch.get(item.epoch, 0) + 1
                owned = (
                    share_of_range(item.epoch * num_rows, (item.epoch + 1) * num_rows, worker, num_workers)
                    if num_rows is not None
                    else None
                )
                if owned is not None and rejected_in_epoch[item.epoch] >= owned:
                    raise RolloutError(
                        f"filter_prompt rejected every prompt of epoch {item.epoch}: no sample can reach the "
                        "trainer"
                    )
                self._put_result(GroupResult(item.stream_index, item.epoch, item.row_index, -1, []))
                continue
            problem = self._prompt_problem(item)
            if problem is not None:
                self._skip_prompt(item, problem)
                continue
            await self._wait_for_allowance()
            await self.slots.wait_for_room()
            group_id = self._next_group_id
            self._next_group_id += self.channels.num_workers
            self.allowance.group_started()
            self.channels.publish_committed_tokens(self.allowance.committed_tokens)
            self.slots.reserve(self.settings.scheduling.num_generations)
            self._watch(asyncio.create_task(self._run_group(item, group_id)))

    def _prompt_problem(self, item: PromptItem) -> str | None:
        """Why a dataset row cannot be generated for (None when it can): no prompt, not a list of
        messages, a chat template that fails on it, or too long for the server."""
        if self.environments is not None and "prompt" not in item.row:
            return None  # the environment's reset() provides the prompt
        prompt = item.row.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m for m in prompt):
            return f"its 'prompt' is not a list of {{'role', 'content'}} messages: {str(prompt)[:80]!r}"
        try:
            length = len(self.loop.render_prompt(prompt, self.loop.tools, group_id=-2 - item.stream_index))
        except Exception as error:  # the chat template refused it: the row is the problem
            return f"the chat template failed on it ({type(error).__name__}: {error})"
        finally:
            self.loop.context.renders.forget(-2 - item.stream_index)
        if length >= self.max_model_len:
            return (
                f"its prompt is {length} tokens, which leaves no room to generate under "
                f"max_model_len={self.max_model_len}"
            )
        return None

    def _skip_prompt(self, item: PromptItem, problem: str) -> None:
        """A bad row is consumed without training, counted, and reported once: a run hours in does
        not stop for one malformed row."""
        if not self._warned_skip:
            self._warned_skip = True
            logger.warning(
                "skipping dataset row %d: %s. Bad rows are skipped and counted (rollout/skipped_prompts); "
                "only the first is reported.",
                item.row_index,
                problem,
            )
        self.loop.metrics.record("rollout/skipped_prompts", 1, Reduce.SUM)
        self._put_result(GroupResult(item.stream_index, item.epoch, item.row_index, -1, []))

    async def _wait_for_allowance(self) -> None:
        """Until the staleness budget lets a new group start. The trainer raises the budget at every
        step. Each of its waits is bounded by vllm_server_timeout, so a trainer that has not moved the
        budget for several times that (a step may hold a few such waits, a checkpoint, long compute)
        is stuck, and the worker says so instead of waiting forever."""
        if self._may_start_group():
            return
        started = moved = time.monotonic()
        held_since = timeline.now_us()
        limit = self.channels.token_allowance.value
        bound = ALLOWANCE_STALL_FACTOR * self.settings.servers.timeout
        while not self._may_start_group():
            await asyncio.sleep(0.01)
            if self.channels.token_allowance.value != limit:
                limit, moved = self.channels.token_allowance.value, time.monotonic()
            elif time.monotonic() - moved > bound:
                raise RolloutError(
                    f"the trainer took no sample for {time.monotonic() - moved:.0f} s while the worker held "
                    f"a full staleness budget ({ALLOWANCE_STALL_FACTOR} x vllm_server_timeout): the trainer "
                    "is stuck"
                )
        self.loop.metrics.record("rollout/backpressure_s", time.monotonic() - started)
        timeline.interval("backpressure", held_since, timeline.now_us(), lane="generate loop")

    def _may_start_group(self) -> bool:
        """The budget is shared by every rollout worker of the run: what the others hold counts."""
        return self.allowance.may_start_group(
            self.channels.token_allowance.value, self.channels.others_committed_tokens()
        )

    async def _run_group(self, item: PromptItem, group_id: int) -> None:
        if "prompt" not in item.row and self.environments is None:
            raise KeyError(f"dataset row {item.row_index} has no 'prompt' column")
        model_version = self.channels.model_version_value.value
        rollouts = await asyncio.gather(
            *(self._run_rollout(item.row, group_id) for _ in range(self.settings.scheduling.num_generations))
        )
        self.loop.context.renders.forget(group_id)
        group = self._make_group(item, group_id, model_version, rollouts)
        blocked_since = time.monotonic()
        group.queued_at = blocked_since
        if self.score_queue.full():
            # Every scorer is busy; each call is bounded by reward_timeout (a group's wait for its
            # teacher by vllm_server_timeout), so a queue that does not move for longer means scoring
            # itself is stuck.
            teachers_s = self.teachers.timeout if self.teachers is not None else 0.0
            bound = self.scoring.reward_timeout + teachers_s + SCORE_QUEUE_GRACE_S
            try:
                await asyncio.wait_for(self.score_queue.put(group), bound)
            except asyncio.TimeoutError:
                raise RewardError(
                    f"no group was scored for {bound:g} s (reward_timeout, the teachers' wait and "
                    f"{SCORE_QUEUE_GRACE_S:g} s)"
                ) from None
            self.loop.metrics.record("rollout/score_block_s", time.monotonic() - blocked_since)
        else:
            self.score_queue.put_nowait(group)

    async def _run_rollout(
        self, row: dict[str, Any], group_id: int
    ) -> tuple[Rollout, float, list, tuple | None]:
        """(the rollout, its duration, its prompt, its environment's reward or None)."""
        await self.slots.acquire()
        started = time.monotonic()
        self._idle.started(started)
        self.channels.requests_running.value = self._idle.running
        lane = self._request_lanes.take()
        started_us = timeline.now_us()
        try:
            while True:
                try:
                    rollout, prompt, env_reward = await self._generate_episode(row, group_id)
                    break
                except ServerLostError as error:
                    if not error.weights_lost:
                        raise
                    # A server answered with weights the trainer never pushed: it restarted from its
                    # checkpoint. It is avoided until the trainer gives it the weights again (the
                    # client waits for a server, within vllm_server_timeout); the rollout starts anew.
                    self.loop.metrics.record("rollout/regenerated_count", 1, Reduce.SUM)
                    self.client.mark_down(error.url)
        finally:
            timeline.interval("rollout", started_us, timeline.now_us(), lane=lane, group=group_id)
            self._request_lanes.give_back(lane)
            self._idle.finished(time.monotonic())
            self.channels.requests_running.value = self._idle.running
            await self.slots.release()
        duration = time.monotonic() - started
        self.share.finished_since_raise += 1
        self._generated_tokens += sum(len(turn.output_ids) for turn in rollout.turns)
        return rollout, duration, prompt, env_reward

    async def _generate_episode(
        self, row: dict[str, Any], group_id: int
    ) -> tuple[Rollout, list, tuple | None]:
        """One rollout of a row: (the rollout, its prompt, its environment's reward or None). With
        environments, each attempt is a fresh episode (reset, tools of the routed environment)."""
        tools = self.loop.tools
        CURRENT_ROW.set(row)  # this rollout's task only: the loop's dataset_row()
        if self.environments is None:
            prompt = row["prompt"]
            return await self.loop.generate_one(prompt, tools, group_id), prompt, None
        async with self.environments.episode(row) as episode:
            rollout = await self.loop.generate_one(episode.prompt, tools + episode.tools, group_id)
            return rollout, episode.prompt, await self.environments.reward(episode.instance)

    def _make_group(self, item: PromptItem, group_id: int, model_version: int, rollouts) -> RolloutGroup:
        columns = {key: value for key, value in item.row.items() if key != "prompt"}
        size = len(rollouts)
        sequences = []
        with_tools = bool(self.loop.tools) or self.environments is not None
        for rollout, duration, _, _ in rollouts:
            built, stats = build_training_sequences(rollout.turns)
            sequences.append(built)
            record_rollout_metrics(
                self.loop.metrics, rollout, duration, len(built), stats, self.loop.eos_token_ids
            )
            if with_tools:
                record_tool_rollout_metrics(self.loop.metrics, rollout)
            self._rewrites.observe(stats.transitions, stats.forks)
        return RolloutGroup(
            prompts=[prompt for _, _, prompt, _ in rollouts],
            reward_kwargs={key: [value] * size for key, value in columns.items()},
            completions=[rollout.completion for rollout, *_ in rollouts],
            completions_ids=[rollout.completion_ids for rollout, *_ in rollouts],
            completions_sequences=sequences,
            tool_call_counts=[rollout.tool_call_count for rollout, *_ in rollouts],
            tool_failure_counts=[rollout.tool_failure_count for rollout, *_ in rollouts],
            model_version=model_version,
            group_id=group_id,
            row_index=item.row_index,
            env_rewards=[env_reward for *_, env_reward in rollouts],
            rollout_rewards=[rollout.reward for rollout, *_ in rollouts],
            stream_index=item.stream_index,
            epoch=item.epoch,
            rollouts=[rollout for rollout, *_ in rollouts],
        )

    # -- scoring --------------------------------------------------------------------------------------------

    async def _score_loop(self, index: int) -> None:
        reward_funcs = self.loop.reward_funcs
        while True:
            group = await self.score_queue.get()
            self.loop.metrics.record("rollout/score_wait_s", time.monotonic() - group.queued_at)
            started = time.monotonic()
            started_us = timeline.now_us()
            where = f" (dataset row {group.row_index})"
            per_function = await call_reward_functions(
                reward_funcs,
                self._reward_executor,
                group.prompts,
                group.completions,
                group.completions_ids,
                group.reward_kwargs,
                timeout_s=self.scoring.reward_timeout,
                where=where,
                catch_errors=self._reward_errors.catches,
            )
            if self._reward_errors.group_failed(per_function, where):  # past the tolerance, it raises
                # A function raised: the group is dropped and counted (rollout/reward_errors.py).
                group.rewards, samples = np.full(len(group.prompts), np.nan), []
                self.loop.metrics.record("rollout/reward_failed_groups", 1, Reduce.SUM)
            else:
                samples = self._scored_samples(group, per_function, reward_funcs)
            if self.teachers is not None and samples:
                samples = await self._teacher_scored(group, samples)
            self.loop.metrics.record("rollout/score_s", time.monotonic() - started)
            timeline.interval(
                "score", started_us, timeline.now_us(), lane=f"scorer {index}", group=group.group_id
            )
            self.allowance.group_finished(
                [int(sum(len(s.token_ids) for s in seqs)) for seqs in group.completions_sequences],
                sum(sample.num_tokens for sample in samples),
            )
            self.channels.publish_committed_tokens(self.allowance.committed_tokens)
            # The group's metrics leave before its samples, so the step that trains them logs them.
            self._flush_metrics()
            scored = group.rewards[~np.isnan(group.rewards)]
            top_reward = float(scored.max()) if len(scored) else None
            self._put_result(
                GroupResult(
                    group.stream_index, group.epoch, group.row_index, group.group_id, samples, top_reward
                )
            )

    def _scored_samples(self, group: RolloutGroup, per_function: list, reward_funcs: list) -> list:
        """The group's rewards summed over every source, its advantages and its training samples
        (none for a group without signal), with its reward metrics recorded."""
        env_names, env_sources, rollout_rewards = checked_extra_sources(
            group.env_rewards, group.rollout_rewards
        )
        sources = [*per_function, *env_sources, rollout_rewards]
        scoring = self.scoring
        group.source_rewards = sources
        group.source_weights = source_weights(scoring.reward_weights, len(per_function), len(sources))
        group.rewards = sum_rewards(sources, len(group.prompts), group.source_weights)
        advantages = np.asarray(self.loop.compute_advantages(group), dtype=np.float64)
        if advantages.shape != (len(group.prompts),):
            raise ContractError(
                f"compute_advantages must return one advantage per rollout ({len(group.prompts)}), "
                f"got shape {advantages.shape}"
            )
        if not np.all(np.isfinite(advantages)):
            raise ContractError(
                "compute_advantages returned a non-finite advantage for dataset row "
                f"{group.row_index}: {advantages}"
            )
        # With a teacher its scores are a signal of their own (distillation, or GRPO's teacher term): every
        # rollout is a sample, and no group is dropped for equal rewards or for having none.
        taught = self.teachers is not None
        dropped = not taught and is_degenerate_group(
            advantage_basis(group, scoring.multi_objective_aggregation)
        )
        left_out = frozenset()
        if scoring.mask_truncated_completions:
            eos = self.loop.eos_token_ids
            left_out = frozenset(i for i, rollout in enumerate(group.rollouts) if is_truncated(rollout, eos))
        samples = [] if dropped else training_samples(group, advantages, left_out, keep_unscored=taught)
        names = [reward_function_name(function) for function in reward_funcs] + env_names
        record_group_metrics(
            self.loop.metrics, group, [*per_function, *env_sources], names, dropped, len(samples)
        )
        return samples

    async def _teacher_scored(self, group: RolloutGroup, samples: list) -> list:
        """The group's samples with their teacher's report at every trained token; none when its
        teacher is lost while another answers (counted in rollout/teacher_lost_groups)."""
        started = time.monotonic()
        teacher = self.teachers.teacher_of(group.reward_kwargs, group.row_index)
        scored = await self.teachers.score_group(samples, teacher)
        self.loop.metrics.record("rollout/teacher_score_s", time.monotonic() - started)
        if scored is None:  # its teacher is lost and another carries the run (rollout/teacher.py)
            self.loop.metrics.record("rollout/teacher_lost_groups", 1, Reduce.SUM)
            return []
        if self.scoring.teacher_kl_coef > 0:  # GRPO with a teacher: the term in every token's advantage
            scored, gaps = with_teacher_terms(scored, self.scoring.teacher_kl_coef)
            if len(gaps):
                self.loop.metrics.record("teacher_kl", float(gaps.mean()), weight=len(gaps))
        self.loop.metrics.record(
            "rollout/teacher_scored_tokens", sum(sample.num_tokens for sample in scored), Reduce.SUM
        )
        return scored

    def _put_result(self, result: GroupResult) -> None:
        self.channels.rollout_buffer.put(result)

    # -- upkeep ---------------------------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        # (A trainer that dies is noticed by the process's parent watch, rollout/worker.py.)
        while True:
            self.channels.heartbeat_value.value = time.time()
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def _metrics_loop(self) -> None:
        while True:  # the gauges reach the trainer even while no group finishes
            await asyncio.sleep(METRICS_FLUSH_INTERVAL_S)
            self._flush_metrics()

    def _flush_metrics(self) -> None:
        """Record the generation gauges (tokens/s since the last flush, concurrency, queue, retries),
        send what the window holds to the trainer (it merges windows by weight) and start anew. Each
        scored group flushes too, so every step's window has the gauges, however short the run.
        The loop's `metrics` is replaced by the fresh window: hooks record into whichever is current."""
        metrics = self.loop.metrics
        now = time.monotonic()
        # The trainer merges the workers' windows as sum(tokens) / sum(seconds); dividing each worker's
        # seconds by the number of workers makes that the run's total rate, not one worker's.
        metrics.record_rate(
            "rollout/generated_tokens_per_s",
            self._generated_tokens,
            (now - self._last_flush) / self.channels.num_workers,
        )
        self._generated_tokens, self._last_flush = 0, now
        metrics.record("rollout/concurrency", self.slots.running)
        metrics.record("rollout/concurrency_cap", self.share.cap)
        metrics.record("rollout/score_queue_size", self.score_queue.qsize())
        retries, moves = self.client.retry_count, self.client.moved_count
        metrics.record("rollout/vllm_retry_count", retries - self._reported_retries, Reduce.SUM)
        metrics.record("rollout/server_lost_regenerated_count", moves - self._reported_moves, Reduce.SUM)
        self._reported_retries, self._reported_moves = retries, moves
        idle_s, elapsed_s = self._idle.take(now)
        metrics.add("perf/generation_idle_frac", Stat(Reduce.RATE, idle_s, elapsed_s))
        self.channels.metrics_queue.put(metrics.stats())
        self.loop.metrics = MetricsWindow()
        events, dropped = self._timeline.take()
        if events or dropped:
            self.channels.timeline_queue.put((events, dropped))
