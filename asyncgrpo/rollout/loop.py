"""AsyncRolloutLoop: the hooks of rollout generation and scoring, the class a user subclasses.

Per prompt: filter_prompt -> generate_one per rollout (calling generate_one_turn per sampling
request) -> once the group is complete, its rewards -> compute_advantages. setup() and close() run
on the worker's event loop. The default implements GRPO; set a subclass as `loop_cls` on a trainer
subclass. The RolloutScheduler (rollout/scheduler.py) calls the hooks and owns everything else;
what a subclass may read and what is private: docs/agents.md, "The rollout loop's hooks".
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.generation.client import SamplingParams, VLLMClient
from asyncgrpo.metrics import MetricsWindow
from asyncgrpo.rollout.activity import ActivityBoard
from asyncgrpo.rollout.advantages import rollout_advantages
from asyncgrpo.rollout.agent import run_tool_loop
from asyncgrpo.rollout.channels import WorkerChannels
from asyncgrpo.rollout.chat import render_prompt_ids
from asyncgrpo.rollout.concurrency import LOAD_POLL_INTERVAL_S
from asyncgrpo.rollout.prompts import CURRENT_ROW
from asyncgrpo.rollout.sampler import PolicySampler
from asyncgrpo.rollout.scheduler import RolloutScheduler, SchedulingArgs
from asyncgrpo.rollout.types import Rollout, RolloutGroup, TurnRecord


class AsyncRolloutLoop:
    """The documented surface of the rollout process: hooks to override, attributes to read."""

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
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        self.lora_name = lora_name
        self.metrics = MetricsWindow()  # replaced by a fresh window at every flush to the trainer
        self.client: VLLMClient | None = None  # set by the scheduler before setup()
        self.max_model_len: int | None = None  # the servers' context length, set before setup()
        # Private: read by the scheduler alone, or set by it before setup() (docs/agents.md).
        self._scheduling = SchedulingArgs(
            channels, score_queue_maxsize, dataset_start_index, frozenset(skip_stream_indices)
        )
        self._sampler: PolicySampler | None = None
        self._tool_executor: ThreadPoolExecutor | None = None
        self._rendered: dict[int, tuple[Any, list[int]]] = {}
        self._activity = ActivityBoard()  # what running rollouts wait on, for the stuck-generation error

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
            raise ConfigurationError(
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
        return await self._sampler.turn(prompt_ids, sampling)

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """One advantage per rollout; NaN rewards get 0. By default the rewards (weighted by
        reward_weights) centered in the group and divided by its std (scale_rewards='group'); with
        'batch', 'none' or GDPO's normalize_then_sum, what the group alone gives (docs/algorithm.md)."""
        return rollout_advantages(group, self.config.scale_rewards, self.config.multi_objective_aggregation)

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

    def dataset_row(self) -> dict[str, Any]:
        """The dataset row of the rollout being generated (called from `generate_one`): the prompt and
        the row's other columns."""
        return CURRENT_ROW.get()

    @property
    def tool_executor(self) -> ThreadPoolExecutor:
        """The thread pool sync tools and environments run on."""
        return self._tool_executor

    # -- running ----------------------------------------------------------------------------------------

    def run(self) -> None:
        """Run until cancelled (SIGTERM from the trainer) or until something fails: what the rollout
        process does with the loop it builds (rollout/worker.py)."""
        RolloutScheduler(self).run()
