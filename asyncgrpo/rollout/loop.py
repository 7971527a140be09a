"""AsyncRolloutLoop: the hooks of rollout generation and scoring, the class a user subclasses.

Per prompt: filter_prompt -> generate_one per rollout (calling generate_one_turn per sampling
request) -> once the group is complete, its rewards -> compute_advantages. setup() and close() run
on the worker's event loop. The default implements GRPO; set a subclass as `loop_cls` on a trainer
subclass. The rollout process builds a RolloutScheduler (rollout/scheduler.py), which builds the
loop from the run's inputs and the hook context, calls the hooks and owns everything else; what a
subclass may read: docs/agents.md, "The rollout loop's hooks".
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.generation.client import VLLMClient
from asyncgrpo.records.metrics import MetricsWindow
from asyncgrpo.rollout.advantages import rollout_advantages
from asyncgrpo.rollout.agent import run_tool_loop
from asyncgrpo.rollout.concurrency import LOAD_POLL_INTERVAL_S
from asyncgrpo.rollout.context import HookContext, LoopInputs
from asyncgrpo.rollout.prompts import CURRENT_ROW
from asyncgrpo.rollout.types import Rollout, RolloutGroup, TurnRecord


class AsyncRolloutLoop:
    """The documented surface of the rollout process: hooks to override, attributes to read."""

    load_poll_interval_s: float = LOAD_POLL_INTERVAL_S  # how often the server's /metrics move the cap

    def __init__(self, inputs: LoopInputs, context: HookContext):
        self.settings = inputs.settings
        self.config = inputs.settings.config  # every config field, a subclass's own included
        self.model_name = inputs.model_name
        self.dataset = inputs.dataset
        self.reward_funcs = list(inputs.reward_funcs)
        self.tokenizer = inputs.processing_class
        self.eos_token_ids = list(inputs.eos_token_ids)
        self.tools = list(inputs.tools)
        self.environment_factory = inputs.environment_factory
        self.lora_name = inputs.lora_name
        self.context = context
        self.metrics = MetricsWindow()  # replaced by a fresh window at every flush to the trainer

    @property
    def client(self) -> VLLMClient:
        """The HTTP client to the vLLM servers."""
        return self.context.client

    @property
    def max_model_len(self) -> int:
        """The servers' context length in tokens."""
        return self.context.max_model_len

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
        sampling = self.settings.sampling
        max_tokens = min(sampling.max_completion_length, self.max_model_len - len(prompt_ids))
        if max_tokens < 1:
            raise ConfigurationError(
                f"a prompt of {len(prompt_ids)} tokens leaves no room to generate under the server's "
                f"max_model_len={self.max_model_len}: shorten the prompts or restart vLLM with a larger "
                "--max-model-len"
            )
        return await self.context.sampler.turn(prompt_ids, sampling.request(max_tokens))

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """One advantage per rollout; NaN rewards get 0. By default the rewards (weighted by
        reward_weights) centered in the group and divided by its std (scale_rewards='group'); with
        'batch', 'none' or GDPO's normalize_then_sum, what the group alone gives (docs/algorithm.md)."""
        scoring = self.settings.scoring
        return rollout_advantages(group, scoring.scale_rewards, scoring.multi_objective_aggregation)

    # -- helpers for hooks -------------------------------------------------------------------------------

    def render_prompt(self, prompt: list[dict[str, Any]], tools: list[Callable], group_id: int) -> list[int]:
        """The prompt's token ids through the chat template, with the tools' schemas (rendered once
        per group when its rollouts share the prompt; an environment's reset() may give each its own)."""
        return self.context.renders.render(prompt, tools, group_id)

    def dataset_row(self) -> dict[str, Any]:
        """The dataset row of the rollout being generated (called from `generate_one`): the prompt and
        the row's other columns."""
        return CURRENT_ROW.get()

    @property
    def tool_executor(self) -> ThreadPoolExecutor:
        """The thread pool sync tools and environments run on."""
        return self.context.tool_executor
