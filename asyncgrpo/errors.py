"""The library's errors (docs/errors.md): one base, `AsyncGRPOError`, and a branch for each part a
user would catch failures of. Every exception class asyncgrpo defines derives from one of them, so
`except AsyncGRPOError` catches whatever the library raises of its own.

Each branch keeps the builtin base its errors had before there was a family (configuration and
contract errors are `ValueError`s, most others `RuntimeError`s), so code that catches those still
catches them.
"""

from __future__ import annotations


class AsyncGRPOError(Exception):
    """Any error asyncgrpo raises of its own (not one it passes on from a library it calls)."""


class ConfigurationError(AsyncGRPOError, ValueError):
    """A setting that cannot work: a config field, a CLI option, an argument, a dataset, a model or a
    checkpoint that does not fit the run, a server started without what the run needs. The message
    names it and says what to set instead."""


class ContractError(AsyncGRPOError, ValueError):
    """What a user's code handed the library breaks the contract its docs state: a custom rollout
    loop's samples or turns, a hook's result, an environment's answer, a metric recorded two ways.
    The message names the rule and the value that broke it."""


class ServerError(AsyncGRPOError, RuntimeError):
    """A vLLM server could not do what the run asked of it."""


class RolloutError(AsyncGRPOError, RuntimeError):
    """Generation in the rollout worker failed: the worker, a rollout loop or an environment."""


class WeightSyncError(AsyncGRPOError, RuntimeError):
    """The trainer's weights could not be moved to the servers."""


class RewardError(AsyncGRPOError, RuntimeError):
    """A reward function (or the verifier behind one) failed."""


class HarnessError(AsyncGRPOError, RuntimeError):
    """An agent harness broke its contract or did not answer in time."""


class CheckpointError(AsyncGRPOError):
    """A checkpoint or the run's output directory could not be written, read or owned. No builtin
    base of its own: a failed save is an `OSError` (CheckpointSaveError), a directory another run
    holds a `RuntimeError` (DirectoryInUseError), as each was before."""


class SandboxError(AsyncGRPOError, RuntimeError):
    """A sandbox could not be set up or run (the message says what to change)."""


class TrainingError(AsyncGRPOError, RuntimeError):
    """The training itself cannot go on: no learning signal, or a loss that is not finite."""
