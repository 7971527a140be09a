"""Checks that need more than the settings (the model, the dataset, the launch), each a clear error at
construction or start instead of a late crash. Settings-only checks live in AsyncGRPOConfig."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import transformers
from packaging.version import Version

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.modeling.peft_adapters import check_peft_config
from asyncgrpo.rollout.environments import EnvironmentOwnedData

# The lowest release pyproject.toml allows (tests/unit/test_transformers_contract.py checks they agree).
MIN_TRANSFORMERS = "5.17.0"


def check_transformers_version() -> None:
    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise ImportError(
            f"AsyncGRPOTrainer needs transformers>={MIN_TRANSFORMERS}, found {transformers.__version__}: "
            f"pip install -U 'transformers>={MIN_TRANSFORMERS}'"
        )


@dataclass(frozen=True)
class TrainerInputs:
    """The trainer's constructor arguments, checked and in the form the run reads them."""

    reward_funcs: list[Callable]
    tools: list[Callable]
    train_dataset: Any  # EnvironmentOwnedData when the environment owns the data
    streaming: bool  # the dataset has no length: epochs cannot end training


def check_trainer_inputs(
    reward_funcs, args, train_dataset, tools, environment_factory, peft_config, rewards_optional: bool
) -> TrainerInputs:
    """The checks of the trainer's arguments that need no model: a refused argument costs no download.
    `rewards_optional`: the loop or the loss brings its own training signal (an agent's
    Rollout.reward, a teacher)."""
    if reward_funcs is None:
        reward_funcs = []
    elif not isinstance(reward_funcs, (list, tuple)):
        reward_funcs = [reward_funcs]
    reward_funcs = list(reward_funcs)
    check_reward_funcs(reward_funcs)
    check_reward_weights(reward_funcs, args.reward_weights)
    tools = list(tools or [])
    check_agent_inputs(reward_funcs, train_dataset, tools, environment_factory, args, rewards_optional)
    if train_dataset is None:  # the environment owns the data (checked above: max_steps is set)
        train_dataset = EnvironmentOwnedData()
    streaming = not hasattr(train_dataset, "__len__")
    check_epochs_can_end(streaming, args.max_steps)
    check_conversational(train_dataset, environment_factory)
    if peft_config is not None:
        check_peft_config(peft_config)
    return TrainerInputs(reward_funcs, tools, train_dataset, streaming)


def check_reward_funcs(reward_funcs: list[Any]) -> None:
    for index, function in enumerate(reward_funcs):
        if isinstance(function, str) or isinstance(function, torch.nn.Module):
            raise ConfigurationError(
                f"reward_funcs[{index}] is {'a model id' if isinstance(function, str) else 'a model'} "
                f"({function if isinstance(function, str) else type(function).__name__}): reward models are "
                "not supported. Pass a Python callable; to score with a model, serve it (vLLM, TGI...) and "
                "call it from an async reward function."
            )
        if not callable(function):
            raise ConfigurationError(f"reward_funcs[{index}] ({function!r}) is not callable")
        check = getattr(function, "check_before_rollouts", None)
        if callable(check):  # code_execution_reward: the sandbox it runs code in must start here
            check()


def check_reward_weights(reward_funcs: list[Any], reward_weights: list[float] | None) -> None:
    """One weight per reward function, as TRL requires (an environment's get_reward and a Rollout.reward
    are reward sources of their own, weighing 1)."""
    if reward_weights is not None and len(reward_weights) != len(reward_funcs):
        raise ConfigurationError(
            f"reward_weights has {len(reward_weights)} weights for {len(reward_funcs)} reward functions: "
            "give one weight per reward function, in reward_funcs' order (or reward_weights=None for 1 each)"
        )


def check_no_injected_protocols(rollout_worker, weight_transfer) -> None:
    """TRL's trainer accepts its own rollout-worker and weight-transfer objects; this one has other
    customisation points."""
    if rollout_worker is not None or weight_transfer is not None:
        raise NotImplementedError(
            "injecting a rollout_worker or weight_transfer object (TRL's protocols) is not supported: "
            "subclass AsyncRolloutLoop (set loop_cls) to change generation, weight_sync_backend to "
            "choose the sync"
        )


def check_epochs_can_end(streaming: bool, max_steps: int) -> None:
    """Without max_steps, epochs counted in prompts end training: a dataset without a length has none."""
    if streaming and max_steps <= 0:
        raise ConfigurationError(
            "an IterableDataset has no length, so epochs cannot end training: set max_steps > 0"
        )


def check_conversational(dataset, environment_factory: Callable | None) -> None:
    """Prompts must be lists of {role, content} messages; images are not supported."""
    if dataset is None:
        return
    column_names = getattr(dataset, "column_names", None) or []
    if "prompt" not in column_names:
        if environment_factory is not None:
            return  # the environment's reset() provides the prompt
        raise ConfigurationError(
            f"train_dataset has no 'prompt' column (columns: {column_names}); each row needs "
            "prompt=[{'role': 'user', 'content': ...}]"
        )
    for image_column in ("image", "images"):
        if image_column in column_names:
            raise ConfigurationError(
                f"train_dataset has an {image_column!r} column: prompts with images are not supported "
                "(vision-language checkpoints train on text-only data, docs/models.md)"
            )
    row = next(iter(dataset))
    prompt = row["prompt"]
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m for m in prompt):
        raise ConfigurationError(
            "prompts must be in conversational format, e.g. [{'role': 'user', 'content': 'What is 2+2?'}]; "
            f"got {type(prompt).__name__}: {str(prompt)[:80]!r}. Wrap a plain-text prompt as "
            "[{'role': 'user', 'content': text}]."
        )
    for message in prompt:
        content = message.get("content")
        if isinstance(content, list) and any(
            isinstance(part, dict) and part.get("type") in ("image", "image_url") for part in content
        ):
            raise ConfigurationError(
                "prompts with images are not supported (vision-language checkpoints train on text-only data, "
                "docs/models.md): use text-only prompts"
            )


def check_prompt_lengths(
    dataset, render: Callable[[list], int], max_model_len: int, limit: int = 20_000
) -> None:
    """Fail before training when a prompt leaves no room to generate under the server's
    max_model_len (the first `limit` rows of a map-style dataset are checked)."""
    if (
        not hasattr(dataset, "__len__")
        or not hasattr(dataset, "__getitem__")
        or "prompt" not in dataset.column_names
    ):
        return
    prompts = dataset[: min(len(dataset), limit)]["prompt"]
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, list):
            continue  # not messages: the rollout worker skips such a row and counts it
        length = render(prompt)
        if length >= max_model_len:
            raise ConfigurationError(
                f"train_dataset row {index}: its prompt is {length} tokens after the chat template, which "
                f"leaves no room to generate under the vLLM server's max_model_len={max_model_len}. Shorten "
                "or filter such prompts, or restart the server with a larger --max-model-len."
            )


def check_launch(num_processes: int, use_cpu: bool) -> None:
    """Several processes launched but the Trainer sees one each: they would all train alone, on the
    same server and output_dir. On CPU, transformers only forms the group with use_cpu=True."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and num_processes == 1:
        hint = "" if use_cpu else " (on CPU-only machines pass use_cpu=True)"
        raise ConfigurationError(
            f"launched on {launched} processes (WORLD_SIZE) but the Trainer runs each alone{hint}; "
            "every process would train its own copy against the same server"
        )


def check_multi_process(deepspeed: bool, has_optimizer: bool) -> None:
    """What several training processes do not support, said before anything starts. An accelerate
    FSDP config is accepted (trainer/fsdp_launch.py); a DeepSpeed one is not."""
    if deepspeed:
        raise ConfigurationError(
            "asyncgrpo shards the model with FSDP2 itself when launched on several processes: launch with "
            "torchrun, `accelerate launch` or an accelerate FSDP config, not a DeepSpeed one"
        )
    if has_optimizer:
        raise ConfigurationError(
            "with several processes the optimizer is built after sharding: do not pass `optimizers`"
        )


def check_agent_inputs(
    reward_funcs: list, train_dataset, tools: list, environment_factory, args, rollouts_scored: bool = False
) -> None:
    """Reward sources, data and tools of a run, said before anything starts. `rollouts_scored`: the
    rollout loop scores its rollouts itself (the harness trainer), so reward_funcs may be empty."""
    from asyncgrpo.rollout.chat import tool_name
    from asyncgrpo.rollout.environments import check_routing, factory_defines_reward

    if (
        not reward_funcs
        and not rollouts_scored
        and (environment_factory is None or not factory_defines_reward(environment_factory))
    ):
        raise ConfigurationError(
            "reward_funcs is empty: give at least one reward function, or an environment_factory whose "
            "environments define get_reward()"
        )
    if train_dataset is None:
        if environment_factory is None:
            raise ConfigurationError(
                "train_dataset is required (it must have a conversational 'prompt' column)"
            )
        if isinstance(environment_factory, dict):
            raise ConfigurationError(
                "environment_factory is a dict but there is no train_dataset: the dataset's 'environment' "
                "column routes each rollout to its environment"
            )
        if args.max_steps <= 0:
            raise ConfigurationError(
                "environment_factory without train_dataset: the environment owns the data, so there are no "
                "epochs to end training; set max_steps > 0 in AsyncGRPOConfig"
            )
    check_routing(environment_factory, train_dataset)
    factories = (
        environment_factory.values() if isinstance(environment_factory, dict) else [environment_factory]
    )
    for factory in factories if environment_factory is not None else []:
        if not callable(factory):
            raise TypeError(
                f"environment_factory must be a class or a callable returning an environment, got {factory!r}"
            )
        if isinstance(factory, type) and not callable(getattr(factory, "reset", None)):
            raise TypeError(
                f"environment class {factory.__name__} has no reset() method (required; it starts an episode)"
            )
    names = []
    for tool in tools:
        if not callable(tool):
            raise TypeError(f"tools must be callables, got {tool!r}")
        names.append(tool_name(tool))
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ConfigurationError(
            f"several tools share the name(s) {duplicates}: the model calls a tool by its __name__"
        )
