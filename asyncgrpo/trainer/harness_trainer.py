"""HarnessAsyncGRPOTrainer: AsyncGRPOTrainer whose rollouts are OpenEnv sessions (docs/harness.md).

Everything but generation is the base trainer's: the step, the weight syncs, staleness, metrics and
checkpoints. Generation runs the harness rollout loop (asyncgrpo/harness/loop.py) in the rollout
worker, given the harness arguments through its constructor.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.errors import ConfigurationError
from asyncgrpo.harness.agent_sandbox import check_factory_before_rollouts
from asyncgrpo.harness.loop import (
    DEFAULT_HARNESS_TIMEOUT_S,
    HarnessRolloutLoop,
    HarnessRolloutOutcome,
    HarnessSettings,
)
from asyncgrpo.trainer.async_grpo_trainer import AsyncGRPOTrainer


class HarnessAsyncGRPOTrainer(AsyncGRPOTrainer):
    """Train an agent program as it is.

    `harness_session_factory`: a callable returning an OpenEnv `ResourceSessionFactory`; without an
    adapter (loop-owning: the agent runs its own loop) it is called with `sampling=` (the run's
    sampling settings) and, when it accepts it, `capture=` (the trainer's capture proxy). With
    `harness_adapter` (an OpenEnv `HarnessAdapter`, white-box) it is called without arguments and the
    adapter asks the trainer for each turn. `rollout_reward_fn(outcome)` turns a
    `HarnessRolloutOutcome` into the reward (default: the session's `verify()` reward); None leaves the
    rollout unscored. `reward_funcs` add to it, as in AsyncGRPOTrainer. `eval_dataset` (by name, as in
    AsyncGRPOTrainer) is evaluated through harness sessions too: the same factory and agent, in the
    trainer's process, on the held-out rows, with the step's weights. `harness_timeout_s` bounds each
    call into the session's own code that no other setting bounds (`create()`, a white-box adapter's
    run, `fetch_training_trace()`, `close()`); `verify()` and `rollout_reward_fn` have
    `reward_timeout`, tools `tool_timeout` (docs/harness.md, "What an agent can and cannot do")."""

    _agent_loop = True

    def __init__(
        self,
        model,
        args: AsyncGRPOConfig | None = None,
        train_dataset=None,
        harness_session_factory: Callable[..., Any] | None = None,
        harness_adapter=None,
        rollout_reward_fn: Callable[[HarnessRolloutOutcome], float | None] | None = None,
        reward_funcs=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        *,
        eval_dataset=None,
        harness_timeout_s: float = DEFAULT_HARNESS_TIMEOUT_S,
    ):
        if not callable(harness_session_factory):
            raise ConfigurationError(
                "harness_session_factory is required: a callable returning an OpenEnv "
                "ResourceSessionFactory, e.g. functools.partial(asyncgrpo.harness.ProcessSessionFactory, "
                "command=[...], verify=...)"
            )
        if train_dataset is None:
            raise ConfigurationError(
                "train_dataset is required: each row's 'prompt' (and columns) is a session's task"
            )
        if not harness_timeout_s > 0:
            raise ConfigurationError(
                f"harness_timeout_s={harness_timeout_s} must be > 0 (seconds a session's own code may take "
                "per call)"
            )
        # Before anything else: an agent sandbox this machine cannot start stops the run here, not at
        # its first rollout (docs/harness.md, "The sandbox").
        check_factory_before_rollouts(harness_session_factory)
        # An instance attribute: the rollout worker builds its loop from this (a picklable partial).
        self.loop_cls = functools.partial(
            HarnessRolloutLoop,
            harness=HarnessSettings(
                harness_session_factory, harness_adapter, rollout_reward_fn, float(harness_timeout_s)
            ),
        )
        super().__init__(
            model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            eval_dataset=eval_dataset,
        )
