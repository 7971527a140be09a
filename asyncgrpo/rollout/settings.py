"""RolloutSettings: what the rollout process reads of the trainer's config, typed, frozen and grouped.

Built in the trainer's process by `rollout_settings(config)` and pickled to the spawned rollout
process: the config itself would make that process import transformers' TrainingArguments to unpickle
it, seconds of CPU at each start for nothing the loop reads (bench/RESULTS.md, "make_test"). Each part
of the rollout process takes the group it uses (sampling, servers, scheduling, tools, scoring,
teachers). `config` keeps every field as plain values for a user's hooks, a config subclass's own
fields included (docs/agents.md, "The rollout loop's hooks").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from asyncgrpo.rollout.prompts import PromptOrder

if TYPE_CHECKING:  # the HTTP client needs msgspec, which the trainer's side of a GPU host may lack
    from asyncgrpo.generation.client import SamplingParams


@dataclass(frozen=True)
class SamplingSettings:
    """How each sampling request is made."""

    max_completion_length: int  # the most tokens one request generates (less where the context ends)
    temperature: float
    top_p: float
    top_k: int  # 0: no top-k restriction
    min_p: float  # 0.0: no min-p restriction (the config's None)
    repetition_penalty: float
    num_top_logprobs: int  # the sampler's top log-probs kept per token (score centering), else 0
    seed: int  # the requests' seeds derive from it
    moe_routing_replay: bool  # whether the servers return each token's routed experts
    chat_template_kwargs: dict[str, Any] | None  # passed to the chat template at every rendering
    parse_reasoning: bool  # whether a turn's <think> block moves to `reasoning_content`

    def request(self, max_tokens: int) -> SamplingParams:
        """The parameters of one request of at most `max_tokens` tokens."""
        from asyncgrpo.generation.client import SamplingParams  # only the rollout process samples

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            num_top_logprobs=self.num_top_logprobs,
        )


@dataclass(frozen=True)
class ServerSettings:
    """How the rollout process reaches the vLLM servers (the policy's and the teachers')."""

    urls: list[str]  # the configured servers, until the trainer sends the live list
    timeout: float  # vllm_server_timeout: how long a server may be unreachable before the run fails
    request_timeout: float  # the most one request may take


@dataclass(frozen=True)
class SchedulingSettings:
    """How many rollouts run, and in which order the prompts come."""

    num_generations: int  # rollouts per prompt (a group)
    max_concurrent_rollouts: int  # the most rollouts running at once; also the tool and reward threads
    prompt_order: PromptOrder  # the order of each epoch's prompts (data_seed or seed; sequential)


@dataclass(frozen=True)
class ToolSettings:
    """The default tool loop's bounds."""

    max_tool_calling_iterations: int | None  # tool turns per rollout; None: until a turn calls no tool
    tool_timeout: float  # the most one tool call may take


@dataclass(frozen=True)
class ScoringSettings:
    """How a group is scored and its advantages computed."""

    reward_timeout: float  # the most one reward function call may take
    reward_error_tolerance: float  # the share of failed reward calls tolerated (rollout/reward_errors.py)
    reward_error_window: int  # the calls that share is counted over
    reward_weights: list[float] | None  # one weight per reward source; None: 1 each
    scale_rewards: str  # "group", "batch" or "none"
    multi_objective_aggregation: str  # "sum_then_normalize" or GDPO's "normalize_then_sum"
    mask_truncated_completions: bool  # whether truncated rollouts are left out of training
    teacher_kl_coef: float  # GRPO with a teacher: the teacher term's coefficient (0: none)


@dataclass(frozen=True)
class TeacherSettings:
    """On-policy distillation's teachers (docs/distillation.md)."""

    urls: dict[str, str]  # teacher id -> its server's URL
    top_k: int  # the teacher's top log-probs reported per token
    temperature: float  # the temperature the teacher's log-probs are taken at


@dataclass(frozen=True)
class RolloutSettings:
    """Everything the rollout process reads of the config, by group."""

    sampling: SamplingSettings
    servers: ServerSettings
    scheduling: SchedulingSettings
    tools: ToolSettings
    scoring: ScoringSettings
    teachers: TeacherSettings | None  # None: a run without a teacher
    config: SimpleNamespace  # every config field as a plain value: what hooks read as `self.config`


def rollout_settings(config) -> RolloutSettings:
    """The settings of the rollout process, from the trainer's config (an AsyncGRPOConfig, a subclass,
    or a copy with the eval settings applied)."""
    urls = getattr(config, "teacher_server_urls", None)
    return RolloutSettings(
        sampling=SamplingSettings(
            max_completion_length=config.max_completion_length,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            min_p=config.min_p or 0.0,
            repetition_penalty=config.repetition_penalty,
            num_top_logprobs=config.num_sampler_logprobs if config.score_centering else 0,
            seed=config.seed,
            moe_routing_replay=config.moe_routing_replay,
            chat_template_kwargs=config.chat_template_kwargs,
            parse_reasoning=config.parse_reasoning,
        ),
        servers=ServerSettings(
            list(config.vllm_server_urls), config.vllm_server_timeout, config.request_timeout
        ),
        scheduling=SchedulingSettings(
            config.num_generations, config.max_concurrent_rollouts, PromptOrder.of(config)
        ),
        tools=ToolSettings(config.max_tool_calling_iterations, config.tool_timeout),
        scoring=ScoringSettings(
            reward_timeout=config.reward_timeout,
            reward_error_tolerance=config.reward_error_tolerance,
            reward_error_window=config.reward_error_window,
            reward_weights=config.reward_weights,
            scale_rewards=config.scale_rewards,
            multi_objective_aggregation=config.multi_objective_aggregation,
            mask_truncated_completions=config.mask_truncated_completions,
            teacher_kl_coef=getattr(config, "teacher_kl_coef", 0.0),
        ),
        teachers=TeacherSettings(dict(urls), config.teacher_top_k, config.teacher_temperature)
        if urls
        else None,
        config=plain_config(config),
    )


def plain_config(config) -> SimpleNamespace:
    """Every field of `config` (a dataclass) as an attribute of a plain object, Enum members as their
    values and nested dataclasses as plain objects too, with the values of asyncgrpo's and a
    subclass's properties (such as vllm_server_urls); transformers' (device, world_size...) would set
    up torch.distributed."""
    values = {
        field.name: _plain(getattr(config, field.name))
        for field in dataclasses.fields(config)
        if hasattr(config, field.name)
    }
    for cls in type(config).__mro__:
        if cls.__module__.split(".")[0] in ("transformers", "builtins"):
            continue
        for name, attribute in vars(cls).items():
            if isinstance(attribute, property) and name not in values:
                values[name] = _plain(getattr(config, name))
    return SimpleNamespace(**values)


def _plain(value):
    if isinstance(value, Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain_config(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(item) for item in value)
    return value
