"""What a rollout loop is built from: the run's inputs (LoopInputs, made by the trainer and pickled
to the rollout process) and the hook context (HookContext, made in that process once the servers
answer). The loop's hooks read both; what each field is for: docs/agents.md, "The rollout loop's
hooks".
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from asyncgrpo.rollout.activity import ActivityBoard
from asyncgrpo.rollout.chat import RenderCache
from asyncgrpo.rollout.settings import RolloutSettings, rollout_settings

if TYPE_CHECKING:  # the HTTP client needs msgspec, which the trainer's side of a GPU host may lack
    from asyncgrpo.generation.client import VLLMClient
    from asyncgrpo.rollout.sampler import PolicySampler


@dataclass(frozen=True)
class LoopInputs:
    """What the trainer hands its rollout loop; everything here must pickle."""

    settings: RolloutSettings  # the config's values the rollout process reads (rollout/settings.py)
    model_name: str  # the served model's name on the vLLM servers
    processing_class: Any  # the tokenizer
    eos_token_ids: list[int]  # the token ids that end a completion
    dataset: Any = None  # the training dataset; None for an evaluation (its rows come per run)
    reward_funcs: list[Callable] = field(default_factory=list)  # the reward functions, in order
    tools: list[Callable] = field(default_factory=list)  # the trainer's tools
    environment_factory: Any = None  # as given to the trainer, or None
    lora_name: str | None = None  # the adapters' name prefix with adapter-only weight sync, else None

    @classmethod
    def of(cls, config, **fields) -> LoopInputs:
        """The inputs, with the settings built from the trainer's `config`; `tools` and
        `reward_funcs` may be None."""
        fields["tools"] = list(fields.get("tools") or [])
        fields["reward_funcs"] = list(fields.get("reward_funcs") or [])
        return cls(rollout_settings(config), **fields)


@dataclass(frozen=True)
class HookContext:
    """What the hooks use that exists only in the running rollout process (or evaluation)."""

    client: VLLMClient  # the HTTP client to the policy's vLLM servers
    sampler: PolicySampler  # one sampling request under the trainer's current policy (rollout/sampler.py)
    max_model_len: int  # the servers' context length in tokens
    tool_executor: ThreadPoolExecutor  # the thread pool sync tools and environments run on
    renders: RenderCache  # prompts rendered once per group (`AsyncRolloutLoop.render_prompt`)
    activity: ActivityBoard  # what running rollouts wait on, named by the stuck-generation error


def hook_context(
    inputs: LoopInputs,
    client: VLLMClient,
    sampler: PolicySampler,
    max_model_len: int,
    tool_executor: ThreadPoolExecutor,
) -> HookContext:
    """The context of a loop built from `inputs`, with an empty render cache and activity board."""
    renders = RenderCache(inputs.processing_class, inputs.settings.sampling.chat_template_kwargs)
    return HookContext(client, sampler, max_model_len, tool_executor, renders, ActivityBoard())
