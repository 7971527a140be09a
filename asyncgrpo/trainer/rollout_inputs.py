"""What a rollout loop is built from, on the trainer's side: the same inputs for training's rollout
workers (trainer/generation_session.py) and for the evaluator (trainer/evaluator.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class RolloutInputs:
    """The trainer's rollout loop class and what its loops score and render with."""

    loop_cls: Callable  # AsyncRolloutLoop, a subclass, or a picklable partial of one
    reward_funcs: list[Callable]
    processing_class: Any  # the tokenizer (or processor) the prompts are rendered with
    eos_token_ids: list[int]
    tools: list[Callable]
    environment_factory: Callable | None

    def loop_kwargs(self, config, model_name: str, dataset, lora_name: str | None, **more) -> dict[str, Any]:
        """The loop's constructor arguments: `config` (the settings it reads), the name the servers
        serve the policy under, the prompts (None for an evaluation: its rows come with each run) and
        the policy adapters' prefix (adapter-only weight sync); `more`: where a worker starts."""
        return dict(
            config=config,
            model_name=model_name,
            dataset=dataset,
            reward_funcs=self.reward_funcs,
            processing_class=self.processing_class,
            eos_token_ids=self.eos_token_ids,
            tools=self.tools,
            environment_factory=self.environment_factory,
            lora_name=lora_name,
            **more,
        )


def eos_token_ids(model: torch.nn.Module, processing_class) -> list[int]:
    """The tokens that end a completion: the tokenizer's and the model's generation config's."""
    ids = {processing_class.eos_token_id}
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif generation_eos:
        ids.update(generation_eos)
    return sorted(token for token in ids if token is not None)
