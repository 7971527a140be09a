"""AsyncGRPOConfig: TrainingArguments plus the asynchronous GRPO fields, with TRL's names and defaults.

Every field of TRL's `AsyncGRPOConfig` keeps its name and default (only the import changes). The
fields are declared by concern in the modules of this package (model, generation, servers, loss, the
loss menu, reward shaping, the reference, pipeline, evaluation, completions table, checkpoints, the
TrainingArguments defaults changed), each with the checks of its own values; this class puts them
together, in the order docs/configuration.md reads.
Values are checked at construction: a bad value fails here with a message saying what to change,
never minutes later inside the worker process.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from transformers import TrainingArguments

from asyncgrpo.config.algorithm import AlgorithmFields
from asyncgrpo.config.checkpoints import CheckpointFields
from asyncgrpo.config.completions_table import CompletionsTableFields
from asyncgrpo.config.evaluation import EvaluationFields
from asyncgrpo.config.generation import GenerationFields
from asyncgrpo.config.loss import LossFields
from asyncgrpo.config.model import ModelFields
from asyncgrpo.config.pipeline import PipelineFields
from asyncgrpo.config.reference import ReferenceFields
from asyncgrpo.config.reward_shaping import RewardShapingFields
from asyncgrpo.config.server import ServerFields
from asyncgrpo.config.teacher import TeacherFields
from asyncgrpo.config.training_arguments import TrainingArgumentsDefaults
from asyncgrpo.config.trl_compat import TrlCompatFields
from asyncgrpo.errors import ConfigurationError


# A dataclass takes its bases' fields from the last base to the first: TrainingArguments' come first
# (output_dir stays the first positional argument), then TRL's compatibility fields, then each group
# in the order of the bases read from right to left.
@dataclass
class AsyncGRPOConfig(
    CheckpointFields,
    CompletionsTableFields,
    EvaluationFields,
    PipelineFields,
    TeacherFields,
    ReferenceFields,
    RewardShapingFields,
    AlgorithmFields,
    LossFields,
    ServerFields,
    GenerationFields,
    ModelFields,
    TrainingArgumentsDefaults,
    TrlCompatFields,
    TrainingArguments,
):
    """Settings of AsyncGRPOTrainer: TrainingArguments plus the asynchronous GRPO fields.

    Field names and defaults are TRL's. docs/configuration.md explains every field; the help texts
    say what each does, its unit and why its default.
    """

    def __post_init__(self) -> None:
        self._resolve_training_arguments()
        self._resolve_model()
        self._resolve_generation()
        self._resolve_server()
        self._resolve_algorithm()  # before the loss's own: score_centering's default depends on loss_type
        self._resolve_loss()
        self._resolve_reward_shaping()
        self._resolve_evaluation()
        self._resolve_teacher()
        self._apply_trl_compat(_DEFAULTS["max_concurrent_rollouts"], _DEFAULTS["rollout_worker_timeout"])
        self._validate()
        super().__post_init__()

    def _validate(self) -> None:
        def fail(message: str) -> None:
            raise ConfigurationError(f"{type(self).__name__}: {message}")

        self._validate_generation(fail)
        self._validate_server(fail)
        self._validate_loss(fail)
        self._validate_algorithm(fail)
        self._validate_reward_shaping(fail)
        self._validate_reference(fail)
        self._validate_teacher(fail)
        self._validate_model(fail)
        self._validate_pipeline(fail)
        self._validate_training_arguments(fail)
        self._validate_evaluation(fail)
        self._validate_completions_table(fail)
        self._validate_checkpoints(fail)


_DEFAULTS = {f.name: f.default for f in fields(AsyncGRPOConfig)}
