"""AsyncRolloutLoop: generates and scores rollouts in the spawned rollout process.

The default implements GRPO; subclass it and override a hook to customize a run (set the subclass
as `loop_cls` on a trainer subclass). Each prompt goes through, in order:
  filter_prompt(row_index, row, epoch) -> generate_one(prompt, tools, group_id) per rollout, which
  calls generate_one_turn(prompt_ids) per sampling request -> once the group is complete, scoring
  (reward functions + Rollout.reward) -> compute_advantages(group) -> samples queued for training.
`setup()` and `close()` run on the loop's event loop (create HTTP clients there, not in __init__).
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from asyncgrpo.generation.client import (
    SamplingParams,
    VLLMClient,
    VLLMRequestError,
    VLLMUnavailableError,
    parse_policy_label,
    policy_adapter_name,
    policy_cache_salt,
)
from asyncgrpo.metrics import MetricsWindow, Reduce
from asyncgrpo.rollout.agent import record_tool_rollout_metrics, run_tool_loop
from asyncgrpo.rollout.channels import WorkerChannels
from asyncgrpo.rollout.chat import RewriteDetector, render_prompt_ids
from asyncgrpo.rollout.concurrency import (
    LOAD_POLL_INTERVAL_S,
    RolloutSlots,
    TokenAllowance,
    initial_cap,
    next_cap,
)
from asyncgrpo.rollout.environments import EnvironmentPool, environment_reward_sources
from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.rollout.prompts import PromptItem, PromptOrder, prompt_stream
from asyncgrpo.rollout.rollout_metrics import record_group_metrics, record_rollout_metrics
from asyncgrpo.rollout.scoring import (
    call_reward_functions,
    finite_reward,
    group_advantages,
    is_degenerate_group,
    reward_function_name,
    sum_rewards,
)
from asyncgrpo.rollout.sequences import build_training_sequences
from asyncgrpo.rollout.types import Rollout, RolloutGroup, TurnRecord
from asyncgrpo.sample import Sample

logger = logging.getLogger(__name__)


class ServerLostWeightsError(RuntimeError):
    """A server answered with weights the trainer did not push (it restarted from its checkpoint)."""


HEARTBEAT_INTERVAL_S = 1.0
METRICS_FLUSH_INTERVAL_S = 1.0
# Groups scored at once. Scoring is mostly waiting (threads, async judges, the event loop running
# generation callbacks between them), so many groups in flight keep it off the critical path.
SCORE_CONCURRENCY = 64
# What the user's close() hook may take when the loop stops, before the process leaves without it.
CLOSE_HOOK_TIMEOUT_S = 30.0
# Beyond reward_timeout, how long a full scoring queue may stand still before scoring counts as stuck.
SCORE_QUEUE_GRACE_S = 60.0
# Adapter-only sync: how many times (about a second apart) a request retries when its policy
# adapter is not loaded (retired by a sync, or being pushed again to a restarted server).
ADAPTER_MISSING_RETRIES = 30
# How many vllm_server_timeouts the trainer may leave the staleness budget unmoved before it counts as stuck.
ALLOWANCE_STALL_FACTOR = 4


class AsyncRolloutLoop:
    load_poll_interval_s: float = LOAD_POLL_INTERVAL_S  # how often the server's /metrics move the cap

    def __init__(
        self,
        config,
        model_name: str,
        dataset,
        reward_funcs: list[Callable],
        processing_class,
        eos_token_ids: list[int],
        channels: WorkerChannels,
        tools: list[Callable] | None = None,
        environment_factory=None,
        score_queue_maxsize: int = 16,
        lora_name: str | None = None,
        dataset_start_index: int = 0,
        skip_stream_indices: frozenset[int] = frozenset(),
    ):
        self.config = config
        self.model_name = model_name
        self.dataset = dataset
        self.reward_funcs = list(reward_funcs)
        self.tokenizer = processing_class
        self.eos_token_ids = list(eos_token_ids)
        self.channels = channels  # the queues and shared values of the trainer (rollout/channels.py)
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        self.score_queue_maxsize = score_queue_maxsize
        self.lora_name = lora_name
        self.dataset_start_index = dataset_start_index
        self.skip_stream_indices = frozenset(skip_stream_indices)
        self.metrics = MetricsWindow()
        self.client: VLLMClient | None = None
        self._request_seeds = random.Random(config.seed)
        self._rendered: dict[int, tuple[Any, list[int]]] = {}
        self.environments: EnvironmentPool | None = None  # made in _main, with the tool thread pool
        self._rewrites = RewriteDetector()
        self._tasks: set[asyncio.Task] = set()

    # -- hooks ---------------------------------------------------------------------------------------

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        """Whether to generate for a prompt. A rejected prompt counts as consumed for the epoch."""
        return True

    async def setup(self) -> None:
        """Create what the other hooks need (e.g. an HTTP client), on the loop's event loop."""

    async def close(self) -> None:
        """Release what setup() created. Runs when the loops stop, errors included."""

    async def generate_one(
        self, prompt: list[dict[str, Any]], tools: list[Callable], group_id: int = 0
    ) -> Rollout:
        """One rollout for a prompt: the multi-turn tool loop (rollout/agent.py), one sampling request
        (TurnRecord) per turn, until a turn calls no tool or max_tool_calling_iterations is reached.
        `tools` are the trainer's tools plus, with environment_factory, the environment's methods."""
        return await run_tool_loop(self, prompt, tools, group_id)

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        """Sample one response from the vLLM server with the config's sampling settings."""
        max_tokens = min(self.config.max_completion_length, self.max_model_len - len(prompt_ids))
        if max_tokens < 1:
            raise ValueError(
                f"a prompt of {len(prompt_ids)} tokens leaves no room to generate under the server's "
                f"max_model_len={self.max_model_len}: shorten the prompts or restart vLLM with a larger "
                "--max-model-len"
            )
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=self.config.temperature,
            top_p=self.config.top_p,
            top_k=self.config.top_k,
            min_p=self.config.min_p or 0.0,
            repetition_penalty=self.config.repetition_penalty,
            num_top_logprobs=self.config.num_sampler_logprobs if self.config.score_centering else 0,
        )
        seed = self._request_seeds.getrandbits(62)
        completion, version = await self._sample(prompt_ids, sampling, seed)
        if completion.weight_labels:  # which weights sampled the tokens (see VLLMClient.complete)
            versions = [parse_policy_label(label) for label in completion.weight_labels]
            if None in versions:
                raise ServerLostWeightsError(
                    f"tokens sampled by weights labelled {completion.weight_labels}: a server restarted and "
                    "runs weights the trainer did not push"
                )
            if not self.lora_name:  # with adapters, the adapter the request named sampled every token
                version = min(versions)
        return TurnRecord(
            prompt_ids=list(prompt_ids),
            output_ids=completion.token_ids.tolist(),
            output_log_probs=completion.logprobs.tolist(),
            output_sampling_mask=[mask.tolist() for mask in completion.sampling_masks]
            if self._candidate_sets and completion.sampling_masks is not None
            else None,
            output_top_ids=completion.top_ids,
            output_top_logprobs=completion.top_logprobs,
            finish_reason=completion.finish_reason,
            model_version=version,
        )

    async def _sample(self, prompt_ids: list[int], sampling: SamplingParams, seed: int):
        """One request under the current policy version; returns (completion, version). With
        adapter-only weight sync (`lora_name` set) each version is its own adapter, named from the
        version, so the request runs to its end under the version it started with."""
        generate = self.client.generate_tokens if self._token_route else self.client.complete
        version, missing = self.channels.model_version_value.value, 0
        while True:
            model = policy_adapter_name(self.lora_name, version) if self.lora_name else None
            try:
                return await generate(
                    prompt_ids, sampling, seed, model=model, cache_salt=policy_cache_salt(version)
                ), version
            except VLLMRequestError as error:
                # The version read just before a sync retired it, or a restarted server is being given
                # the current adapter again: take the newest version once it is there.
                missing += 1
                if not self.lora_name or error.status != 404 or missing > ADAPTER_MISSING_RETRIES:
                    raise
                if self.channels.model_version_value.value == version:
                    await asyncio.sleep(1.0)
                version = self.channels.model_version_value.value

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """One advantage per rollout: rewards normalized in the group; NaN rewards get 0."""
        return group_advantages(group.rewards)

    # -- helpers for hooks -------------------------------------------------------------------------------

    def render_prompt(self, prompt: list[dict[str, Any]], tools: list[Callable], group_id: int) -> list[int]:
        """The prompt's token ids through the chat template, with the tools' schemas (rendered once
        per group when its rollouts share the prompt; an environment's reset() may give each its own)."""
        cached = self._rendered.get(group_id)
        if cached is not None and cached[0] is prompt:
            return cached[1]
        ids = render_prompt_ids(self.tokenizer, prompt, tools, self.config.chat_template_kwargs)
        self._rendered[group_id] = (prompt, ids)
        return ids

    @property
    def tool_executor(self) -> ThreadPoolExecutor:
        """The thread pool sync tools and environments run on."""
        return self._tool_executor

    def _make_thread_pools(self) -> None:
        """Sync tools and environments get max_concurrent_rollouts threads, one per running rollout,
        so a tool call never waits for a thread. Sync reward functions get their own pool: groups
        scored at once (up to SCORE_CONCURRENCY) with a slow judge must not take the tools' threads."""
        size = self.config.max_concurrent_rollouts
        self._tool_executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="tool")
        self._reward_executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="reward")

    # -- the process's main -------------------------------------------------------------------------------

    def run(self) -> None:
        """Run until cancelled (SIGTERM from the trainer) or until something fails."""
        asyncio.run(self._main())

    async def _main(self) -> None:
        config = self.config
        # The trainer stops the worker with SIGTERM: unwind through the finally below (close() runs).
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
        self._make_thread_pools()
        if self.environment_factory is not None:
            self.environments = EnvironmentPool(
                self.environment_factory, self._tool_executor, lambda: self.metrics
            )
        self.client = VLLMClient(
            config.vllm_server_urls,
            timeout=config.vllm_server_timeout,
            model=self.model_name,
            request_timeout=config.request_timeout,
        )
        try:
            await self.client.wait_until_ready()
            self.max_model_len = await self.client.max_model_len()
            self._candidate_sets = await self._wants_candidate_sets()
            # Token in, token out wherever the server offers it: the same samples, far less work
            # for the server's API process than `/v1/completions`, which detokenizes every top
            # log-prob (bench/RESULTS.md, "overlap").
            self._token_route = self._candidate_sets or await self.client.supports_token_generate()
            await self.setup()
            await self._start_state()
            self.channels.ready_event.set()
            self._fatal: asyncio.Future = asyncio.get_running_loop().create_future()
            loops = [
                self._generate_loop(),
                self._heartbeat_loop(),
                self._load_loop(),
                self._metrics_loop(),
                *(self._score_loop() for _ in range(SCORE_CONCURRENCY)),
            ]
            for coroutine in loops:
                self._watch(asyncio.create_task(coroutine))
            await self._fatal
        finally:
            for task in getattr(self, "_tasks", ()):
                task.cancel()
            await asyncio.gather(*getattr(self, "_tasks", ()), return_exceptions=True)
            try:
                await asyncio.wait_for(self.close(), CLOSE_HOOK_TIMEOUT_S)
            except asyncio.TimeoutError:
                logger.warning(
                    "the rollout loop's close() did not finish within %.0f s; leaving without it",
                    CLOSE_HOOK_TIMEOUT_S,
                )
            finally:
                await self.client.close()
                self._tool_executor.shutdown(wait=False, cancel_futures=True)
                self._reward_executor.shutdown(wait=False, cancel_futures=True)

    async def _wants_candidate_sets(self) -> bool:
        if self.config.top_p >= 1.0 and self.config.top_k == 0 and not (self.config.min_p or 0) > 0:
            return False
        if await self.client.supports_sampling_mask():
            return True
        logger.warning(
            "top_p/top_k/min_p are set but the vLLM server does not return candidate sets (start it with "
            "--return-sampling-mask --enable-scale-out, vLLM >= 0.28): the trainer normalizes over the full "
            "vocabulary, so importance ratios are biased"
        )
        return False

    async def _start_state(self) -> None:
        config = self.config
        self.allowance = TokenAllowance(config.num_generations)
        load = await self.client.load()
        self._has_metrics = load is not None
        cap = initial_cap(
            load.kv_cache_tokens if load else 0, self.max_model_len, config.max_concurrent_rollouts
        )
        self.concurrency_cap = cap
        self.slots = RolloutSlots(
            min(cap, config.max_concurrent_rollouts), stall_timeout_s=config.vllm_server_timeout
        )
        self.score_queue: asyncio.Queue = asyncio.Queue(maxsize=self.score_queue_maxsize)
        self._finished_since_raise = 0
        self._generated_tokens = 0
        self._last_flush = time.monotonic()
        self._last_preemptions = load.preemptions if load else 0
        self._reported_retries = 0
        self._next_group_id = 0
        self._warned_skip = False

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
        rejected_in_epoch: dict[int, int] = {}
        order = PromptOrder.of(self.config)  # data_seed (or seed) and train_sampling_strategy
        stream = prompt_stream(self.dataset, order.seed, self.dataset_start_index, self.skip_stream_indices)
        num_rows = len(self.dataset) if hasattr(self.dataset, "__len__") else None
        for item in stream:
            if not self.filter_prompt(item.row_index, item.row, item.epoch):
                rejected_in_epoch[item.epoch] = rejected_in_epoch.get(item.epoch, 0) + 1
                if num_rows is not None and rejected_in_epoch[item.epoch] >= num_rows:
                    raise RuntimeError(
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
            self._next_group_id += 1
            self.allowance.group_started()
            self.slots.reserve(self.config.num_generations)
            self._watch(asyncio.create_task(self._run_group(item, group_id)))

    def _prompt_problem(self, item: PromptItem) -> str | None:
        """Why a dataset row cannot be generated for (None when it can): no prompt, not a list of
        messages, a chat template that fails on it, or too long for the server."""
        if self.environment_factory is not None and "prompt" not in item.row:
            return None  # the environment's reset() provides the prompt
        prompt = item.row.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m for m in prompt):
            return f"its 'prompt' is not a list of {{'role', 'content'}} messages: {str(prompt)[:80]!r}"
        try:
            length = len(self.render_prompt(prompt, self.tools, group_id=-2 - item.stream_index))
        except Exception as error:  # the chat template refused it: the row is the problem
            return f"the chat template failed on it ({type(error).__name__}: {error})"
        finally:
            self._rendered.pop(-2 - item.stream_index, None)
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
        self.metrics.record("rollout/skipped_prompts", 1, Reduce.SUM)
        self._put_result(GroupResult(item.stream_index, item.epoch, item.row_index, -1, []))

    async def _wait_for_allowance(self) -> None:
        """Until the staleness budget lets a new group start. The trainer raises the budget at every
        step. Each of its waits is bounded by vllm_server_timeout, so a trainer that has not moved the
        budget for several times that (a step may hold a few such waits, a checkpoint, long compute)
        is stuck, and the worker says so instead of waiting forever."""
        if self.allowance.may_start_group(self.channels.token_allowance.value):
            return
        started = moved = time.monotonic()
        limit = self.channels.token_allowance.value
        bound = ALLOWANCE_STALL_FACTOR * self.config.vllm_server_timeout
        while not self.allowance.may_start_group(self.channels.token_allowance.value):
            await asyncio.sleep(0.01)
            if self.channels.token_allowance.value != limit:
                limit, moved = self.channels.token_allowance.value, time.monotonic()
            elif time.monotonic() - moved > bound:
                raise RuntimeError(
                    f"the trainer took no sample for {time.monotonic() - moved:.0f} s while the worker held "
                    f"a full staleness budget ({ALLOWANCE_STALL_FACTOR} x vllm_server_timeout): the trainer "
                    "is stuck"
                )
        self.metrics.record("rollout/backpressure_s", time.monotonic() - started)

    async def _run_group(self, item: PromptItem, group_id: int) -> None:
        if "prompt" not in item.row and self.environments is None:
            raise KeyError(f"dataset row {item.row_index} has no 'prompt' column")
        model_version = self.channels.model_version_value.value
        rollouts = await asyncio.gather(
            *(self._run_rollout(item.row, group_id) for _ in range(self.config.num_generations))
        )
        self._rendered.pop(group_id, None)
        group = self._make_group(item, group_id, model_version, rollouts)
        blocked_since = time.monotonic()
        group.queued_at = blocked_since
        if self.score_queue.full():
            # Every scorer is busy; each call is bounded by reward_timeout, so a queue that does not
            # move for longer means scoring itself is stuck.
            bound = self.config.reward_timeout + SCORE_QUEUE_GRACE_S
            try:
                await asyncio.wait_for(self.score_queue.put(group), bound)
            except asyncio.TimeoutError:
                raise RuntimeError(
                    f"no group was scored for {bound:g} s (reward_timeout + {SCORE_QUEUE_GRACE_S:g} s)"
                ) from None
            self.metrics.record("rollout/score_block_s", time.monotonic() - blocked_since)
        else:
            self.score_queue.put_nowait(group)

    async def _run_rollout(
        self, row: dict[str, Any], group_id: int
    ) -> tuple[Rollout, float, list, tuple | None]:
        """(the rollout, its duration, its prompt, its environment's reward or None)."""
        await self.slots.acquire()
        started = time.monotonic()
        try:
            while True:
                try:
                    rollout, prompt, env_reward = await self._generate_episode(row, group_id)
                    break
                except ServerLostWeightsError:
                    # A server answered with weights the trainer never pushed: it restarted from its
                    # checkpoint. Wait until every server runs the trainer's weights again (the trainer
                    # pushes them), then sample anew.
                    self.metrics.record("rollout/regenerated_count", 1, Reduce.SUM)
                    await self._wait_for_trainer_weights()
        finally:
            await self.slots.release()
        duration = time.monotonic() - started
        self._finished_since_raise += 1
        self._generated_tokens += sum(len(turn.output_ids) for turn in rollout.turns)
        return rollout, duration, prompt, env_reward

    async def _wait_for_trainer_weights(self) -> None:
        """Until every server reports a weight label the trainer set; at most vllm_server_timeout."""
        deadline = time.monotonic() + self.config.vllm_server_timeout
        while True:
            labels = await self.client.weight_labels()
            if all(parse_policy_label(label) is not None for label in labels):
                return
            if time.monotonic() > deadline:
                lost = [
                    url
                    for url, label in zip(self.client.base_urls, labels)
                    if parse_policy_label(label) is None
                ]
                raise ServerLostWeightsError(
                    f"vLLM server(s) {', '.join(lost)} came back without the trainer's weights and the "
                    "trainer did not push them within "
                    f"vllm_server_timeout={self.config.vllm_server_timeout:g} s"
                )
            await asyncio.sleep(1.0)

    async def _generate_episode(
        self, row: dict[str, Any], group_id: int
    ) -> tuple[Rollout, list, tuple | None]:
        """One rollout of a row: (the rollout, its prompt, its environment's reward or None). With
        environments, each attempt is a fresh episode (reset, tools of the routed environment)."""
        if self.environments is None:
            prompt = row["prompt"]
            return await self.generate_one(prompt, self.tools, group_id), prompt, None
        async with self.environments.episode(row) as episode:
            rollout = await self.generate_one(episode.prompt, self.tools + episode.tools, group_id)
            return rollout, episode.prompt, await self.environments.reward(episode.instance)

    def _make_group(self, item: PromptItem, group_id: int, model_version: int, rollouts) -> RolloutGroup:
        columns = {key: value for key, value in item.row.items() if key != "prompt"}
        size = len(rollouts)
        sequences, reconcile = [], []
        with_tools = bool(self.tools) or self.environments is not None
        for rollout, duration, _, _ in rollouts:
            built, stats = build_training_sequences(rollout.turns)
            sequences.append(built)
            reconcile.append(stats)
            record_rollout_metrics(self.metrics, rollout, duration, len(built), stats, self.eos_token_ids)
            if with_tools:
                record_tool_rollout_metrics(self.metrics, rollout)
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

    async def _score_loop(self) -> None:
        while True:
            group = await self.score_queue.get()
            self.metrics.record("rollout/score_wait_s", time.monotonic() - group.queued_at)
            started = time.monotonic()
            per_function = await call_reward_functions(
                self.reward_funcs,
                self._reward_executor,
                group.prompts,
                group.completions,
                group.completions_ids,
                group.reward_kwargs,
                timeout_s=self.config.reward_timeout,
                where=f" (dataset row {group.row_index})",
            )
            env_names, env_sources = environment_reward_sources(group.env_rewards)
            env_sources = [
                [
                    None if value is None else finite_reward(value, "an environment's get_reward()")
                    for value in source
                ]
                for source in env_sources
            ]
            rollout_rewards = [
                None
                if reward is None
                else finite_reward(float(reward), "a Rollout.reward set by generate_one")
                for reward in group.rollout_rewards
            ]
            group.rewards = sum_rewards([*per_function, *env_sources, rollout_rewards], len(group.prompts))
            advantages = np.asarray(self.compute_advantages(group), dtype=np.float64)
            if advantages.shape != (len(group.prompts),):
                raise ValueError(
                    f"compute_advantages must return one advantage per rollout ({len(group.prompts)}), "
                    f"got shape {advantages.shape}"
                )
            if not np.all(np.isfinite(advantages)):
                raise ValueError(
                    "compute_advantages returned a non-finite advantage for dataset row "
                    f"{group.row_index}: {advantages}"
                )
            dropped = is_degenerate_group(group.rewards)
            samples = [] if dropped else self._samples(group, advantages)
            names = [reward_function_name(function) for function in self.reward_funcs] + env_names
            record_group_metrics(
                self.metrics, group, [*per_function, *env_sources], names, dropped, len(samples)
            )
            self.metrics.record("rollout/score_s", time.monotonic() - started)
            self.allowance.group_finished(
                [int(sum(len(s.token_ids) for s in seqs)) for seqs in group.completions_sequences],
                sum(sample.num_tokens for sample in samples),
            )
            # The group's metrics leave before its samples, so the step that trains them logs them.
            self._flush_metrics()
            scored = group.rewards[~np.isnan(group.rewards)]
            top_reward = float(scored.max()) if len(scored) else None
            self._put_result(
                GroupResult(
                    group.stream_index, group.epoch, group.row_index, group.group_id, samples, top_reward
                )
            )

    def _samples(self, group: RolloutGroup, advantages: np.ndarray) -> list[Sample]:
        """Training samples of a kept group. Unscored rollouts (advantage 0) add no gradient, only
        forward cost, so they are not queued."""
        samples = []
        now = time.time()
        for index, sequences in enumerate(group.completions_sequences):
            if np.isnan(group.rewards[index]):
                continue
            for sequence in sequences:
                samples.append(
                    Sample(
                        token_ids=sequence.token_ids,
                        trained=sequence.trained,
                        sampler_logprobs=sequence.sampler_logprobs,
                        advantage=float(advantages[index]),
                        group_id=group.group_id,
                        top_ids=sequence.top_ids,
                        top_logprobs=sequence.top_logprobs,
                        candidate_sets=sequence.candidate_sets,
                        model_version=sequence.model_version,
                        row_index=group.row_index,
                        stream_index=group.stream_index,
                        epoch=group.epoch,
                        reward=float(group.rewards[index]),
                        rollout_id=group.rollouts[index].rollout_id,
                        queued_at=now,
                    )
                )
        return samples

    def _put_result(self, result: GroupResult) -> None:
        self.channels.rollout_buffer.put(result)

    # -- upkeep ---------------------------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        # (A trainer that dies is noticed by the process's parent watch, rollout/worker.py.)
        while True:
            self.channels.heartbeat_value.value = time.time()
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def _load_loop(self) -> None:
        """Read the servers' load now and every `load_poll_interval_s`, and move the cap."""
        while True:
            try:
                load = await self.client.load()
            except VLLMUnavailableError as error:
                # A server down (restarting?): keep the cap. Generation waits for it, within
                # vllm_server_timeout, and fails naming it if it does not come back.
                logger.warning(
                    "reading the vLLM servers' load: %s; keeping the concurrency cap at %d",
                    error,
                    self.concurrency_cap,
                )
                await asyncio.sleep(self.load_poll_interval_s)
                continue
            if load is None:
                cap = self.config.max_concurrent_rollouts
            else:
                cap, raised = next_cap(
                    self.concurrency_cap,
                    load,
                    self._finished_since_raise,
                    self.config.max_concurrent_rollouts,
                )
                if raised:
                    self._finished_since_raise = 0
                self.metrics.record("rollout/vllm_kv_cache_usage_frac", load.kv_cache_usage)
                self.metrics.record("rollout/vllm_running_requests", load.running)
                self.metrics.record("rollout/vllm_queued_requests", load.waiting)
                self.metrics.record(
                    "rollout/vllm_preemption_count",
                    max(0, load.preemptions - self._last_preemptions),
                    Reduce.SUM,
                )
                self._last_preemptions = load.preemptions
            if cap != self.concurrency_cap:
                self.concurrency_cap = cap
                await self.slots.set_limit(cap)
            await asyncio.sleep(self.load_poll_interval_s)

    async def _metrics_loop(self) -> None:
        while True:  # the gauges reach the trainer even while no group finishes
            await asyncio.sleep(METRICS_FLUSH_INTERVAL_S)
            self._flush_metrics()

    def _flush_metrics(self) -> None:
        """Record the generation gauges (tokens/s since the last flush, concurrency, queue, retries),
        send what the window holds to the trainer (it merges windows by weight) and start anew. Each
        scored group flushes too, so every step's window has the gauges, however short the run."""
        now = time.monotonic()
        self.metrics.record_rate(
            "rollout/generated_tokens_per_s", self._generated_tokens, now - self._last_flush
        )
        self._generated_tokens, self._last_flush = 0, now
        self.metrics.record("rollout/concurrency", self.slots.running)
        self.metrics.record("rollout/concurrency_cap", self.concurrency_cap)
        self.metrics.record("rollout/score_queue_size", self.score_queue.qsize())
        retries = self.client.retry_count
        self.metrics.record("rollout/vllm_retry_count", retries - self._reported_retries, Reduce.SUM)
        self._reported_retries = retries
        self.channels.metrics_queue.put(self.metrics.stats())
        self.metrics = MetricsWindow()
