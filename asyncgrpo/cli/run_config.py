"""Config-file runs (`asyncgrpo train CONFIG.yaml [--key value ...]`): read, check, build.

A config is one flat YAML mapping. Its keys are either the run's own keys (below) or any field of the
trainer's config: AsyncGRPOConfig's (`max_steps`, `learning_rate`, `vllm_server_base_url`, ...), or with
`trainer: distillation` AsyncDistillationConfig's (docs/distillation.md). Code is named by
import path, `module:attribute` (`asyncgrpo.rewards:accuracy_reward`); the current directory is
importable, as with `python -m`. Everything is checked before anything slow (model, dataset, server):
an unknown key names the closest valid ones, a wrong type names the expected one, an import path
that does not resolve says which part failed.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from asyncgrpo.cli.config_values import accepts, as_list, expect, float_from_text, matches, type_name
from asyncgrpo.errors import ConfigurationError

RUN_KEYS = {
    "trainer": "`grpo` (the default: AsyncGRPOTrainer) or `distillation` (AsyncDistillationTrainer: the "
    "fields are AsyncDistillationConfig's; the student learns from its teachers, with no reward functions)",
    "teacher_models": "teacher id -> the model its server serves, for `asyncgrpo serve --for CONFIG "
    "--teacher ID`; the ids are teacher_server_urls'",
    "model": "a Hub id or a local model directory",
    "dataset": "the training prompts: a mapping (see DATASET_KEYS)",
    "eval_dataset": "held-out prompts evaluated during training: a mapping like `dataset`, or name -> one",
    "reward_funcs": "one import path or a list of them; an entry {function: path, kwargs: {...}} calls a "
    "factory, e.g. asyncgrpo.rewards:get_soft_overlong_punishment",
    "tools": "a list of import paths of tool functions",
    "environment_factory": "an import path, or a mapping name -> import path",
    "loop_class": "import path of an AsyncRolloutLoop subclass that replaces the default loop",
    "peft_config": "LoraConfig keyword arguments (r, lora_alpha, target_modules, ...)",
    "warm_start": "a step run on the loaded model before GRPO: {function: import path, kwargs: {...}}",
    "harness_session_factory": "train an agent program (HarnessAsyncGRPOTrainer): import path of a callable "
    "returning an OpenEnv ResourceSessionFactory, or the local-process harness (see HARNESS_PROCESS_KEYS)",
    "rollout_reward_fn": "with harness_session_factory: import path of f(outcome) -> reward or None",
    "harness_timeout_s": "with harness_session_factory: seconds a session's own code may take per call "
    "(create, a white-box adapter's run, close; default 1800)",
}
HARNESS_PROCESS_KEYS = {
    "command": "the agent's argv, a list (run in a fresh working directory per rollout); a first element "
    "`python` or `python3` is the trainer's own interpreter, so the agent has the trainer environment's "
    "packages whether or not it is activated",
    "verify": "import path of verify(workdir, transcript, row) -> reward or None",
    "timeout_s": "seconds an agent may run (default 300)",
    "env": "environment variables added to the agent's minimal environment",
    "agent_columns": "the dataset columns the agent sees beside the prompt, a list (default: none)",
    "max_agents": "agent processes alive at once (default: from the machine's cores and memory)",
    "agent_sandbox": "`bubblewrap` (default: every agent in a sandbox) or `none` (opt out, warned about)",
    "agent_limits": "the sandbox's bounds, a mapping of SandboxLimits fields (memory_bytes, processes, "
    "cpu_seconds, file_bytes, disk_bytes, open_files)",
    "agent_readable_paths": "host paths the sandboxed agent may read, a list",
    "agent_writable_paths": "host paths the sandboxed agent may write, a list (shared by every agent)",
}
TRAINERS = ("grpo", "distillation")
# The run keys a distillation run has no use for, and why: AsyncDistillationTrainer learns from its teachers.
NOT_FOR_DISTILLATION = {
    "reward_funcs": "distillation learns from its teachers and takes no reward functions; for a reward and a "
    "teacher together, train GRPO with teacher_kl_coef (examples/reward_and_teacher.yaml)",
    "tools": "AsyncDistillationTrainer takes no tools",
    "environment_factory": "AsyncDistillationTrainer takes no environments",
    "loop_class": "AsyncDistillationTrainer takes no custom rollout loop",
    "harness_session_factory": "the harness trains with GRPO (HarnessAsyncGRPOTrainer)",
    "rollout_reward_fn": "the harness trains with GRPO (HarnessAsyncGRPOTrainer)",
    "harness_timeout_s": "the harness trains with GRPO (HarnessAsyncGRPOTrainer)",
}
# A config file cannot name the trainer's interpreter; these names in a harness command mean it. On the
# PATH they may name another Python (the system's, when the trainer's venv is not activated) that lacks
# the packages the agent imports.
BARE_PYTHON_NAMES = {"python", "python3"}
DATASET_KEYS = {
    "name": "a Hub dataset id (load_dataset(name))",
    "subset": "the Hub dataset's configuration name",
    "data_files": "local files (a path, a list, or split -> paths); the format comes from the extension",
    "format": "the `datasets` builder for data_files: json, csv, parquet, text (default: from the extension)",
    "split": "the split to train on (default: train)",
    "columns": "renames, source column -> name the trainer expects (e.g. {question: prompt})",
}
WARM_START_KEYS = {
    "function": "import path of f(model, tokenizer, **kwargs)",
    "kwargs": "its keyword arguments",
}
REWARD_FACTORY_KEYS = {
    "function": "import path of a factory returning the reward function",
    "kwargs": "the factory's keyword arguments",
}
_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


@dataclass
class RunConfig:
    model: str
    args: Any  # AsyncGRPOConfig, or AsyncDistillationConfig with trainer "distillation"
    trainer: str = "grpo"  # one of TRAINERS
    teacher_models: dict[str, str] = field(default_factory=dict)  # teacher id -> the model it serves
    reward_funcs: list[Callable] = field(default_factory=list)
    dataset: dict | None = None
    eval_dataset: dict | None = None  # one dataset mapping, or name -> dataset mapping
    tools: list[Callable] = field(default_factory=list)
    environment_factory: Any = None
    loop_class: type | None = None
    peft_config: dict | None = None
    warm_start: dict | None = None
    harness_session_factory: Any = None  # a callable returning a ResourceSessionFactory
    rollout_reward_fn: Callable | None = None
    harness_timeout_s: float | None = None
    raw: dict = field(default_factory=dict)  # the merged mapping, as written to the run directory


# -- reading ----------------------------------------------------------------------------------------


def read_config(path: str | Path, overrides: list[str] | None = None) -> dict:
    """The YAML mapping at `path` with the command-line overrides applied."""
    import yaml

    path = Path(path)
    if not path.exists():
        raise ConfigurationError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigurationError(f"{path} is not valid YAML: {error}") from error
    if not isinstance(raw, dict):
        raise ConfigurationError(f"{path} must hold a mapping of keys to values, not a {type(raw).__name__}")
    for key, value in parse_overrides(overrides or []).items():
        _set_dotted(raw, key, value)
    return raw


def parse_overrides(tokens: list[str]) -> dict[str, Any]:
    """`--key value` or `--key=value` pairs; dashes in keys become underscores, `a.b` reaches into a
    section, and values are read as YAML (`3` is an int, `true` a bool, `[a, b]` a list)."""
    import yaml

    overrides, index = {}, 0
    while index < len(tokens):
        token = tokens[index]
        if not token.startswith("--") or token == "--":
            raise ConfigurationError(f"expected --key value after the config file, got {token!r}")
        key, has_value, value = token[2:].partition("=")
        if not has_value:
            if index + 1 >= len(tokens) or tokens[index + 1].startswith("--"):
                raise ConfigurationError(f"--{key} needs a value (--{key} VALUE or --{key}=VALUE)")
            value = tokens[index + 1]
            index += 1
        overrides[key.replace("-", "_")] = yaml.safe_load(value) if value != "" else ""
        index += 1
    return overrides


def _set_dotted(mapping: dict, key: str, value: Any) -> None:
    *sections, last = key.split(".")
    for section in sections:
        mapping = mapping.setdefault(section, {})
        if not isinstance(mapping, dict):
            raise ConfigurationError(f"--{key}: {section} is not a section")
    mapping[last] = value


# -- checking ---------------------------------------------------------------------------------------


def build_run_config(raw: dict) -> RunConfig:
    """Check every key, type and import path of `raw`; build the trainer's config (AsyncGRPOConfig, or
    AsyncDistillationConfig with `trainer: distillation`)."""
    trainer = _trainer(raw)
    config_class = _config_class(trainer)
    arg_names = {f.name for f in fields(config_class) if f.init}
    _reject_keys_of_the_other_trainer(raw, trainer)
    _reject_unknown(raw, set(RUN_KEYS) | arg_names, "")
    if "model" not in raw:
        raise ConfigurationError("the config has no `model`: give a Hub id or a local model directory")
    model = expect(raw["model"], str, "model")
    args = _training_arguments(raw, config_class, arg_names, model)
    teacher_models = _teacher_models(raw, args.teacher_server_urls)
    dataset, eval_dataset = _checked_datasets(raw)
    environment = _environment_factory(raw)
    if dataset is None and environment is None:
        raise ConfigurationError(
            "the config has no `dataset`: give one (or an environment_factory that makes prompts)"
        )
    loop_class = _loop_class(raw)
    warm_start = _warm_start(raw)
    harness, rollout_reward_fn = _harness(raw)
    peft_config = expect(raw["peft_config"], dict, "peft_config") if "peft_config" in raw else None
    if peft_config is not None:
        _reject_unknown(peft_config, _lora_config_keys(), "peft_config.")
    return RunConfig(
        model=model,
        args=args,
        trainer=trainer,
        teacher_models=teacher_models,
        reward_funcs=[
            _reward_function(entry, f"reward_funcs[{i}]")
            for i, entry in enumerate(as_list(raw.get("reward_funcs")))
        ],
        dataset=dataset,
        eval_dataset=eval_dataset,
        tools=[resolve(path, f"tools[{i}]") for i, path in enumerate(as_list(raw.get("tools")))],
        environment_factory=environment,
        loop_class=loop_class,
        peft_config=peft_config,
        warm_start=warm_start,
        harness_session_factory=harness,
        rollout_reward_fn=rollout_reward_fn,
        harness_timeout_s=float(raw["harness_timeout_s"]) if "harness_timeout_s" in raw else None,
        raw=raw,
    )


def _trainer(raw: dict) -> str:
    trainer = raw.get("trainer", "grpo")
    if trainer not in TRAINERS:
        raise ConfigurationError(f"trainer: expected one of {', '.join(TRAINERS)}, got {trainer!r}")
    return trainer


def _config_class(trainer: str) -> type:
    from asyncgrpo.config import AsyncDistillationConfig, AsyncGRPOConfig

    return AsyncDistillationConfig if trainer == "distillation" else AsyncGRPOConfig


def _reject_keys_of_the_other_trainer(raw: dict, trainer: str) -> None:
    """Distillation is asked for by `trainer: distillation` alone: a distillation field in a GRPO config,
    or a run key distillation cannot use in a distillation config, is refused saying why."""
    if trainer == "distillation":
        for key, why in NOT_FOR_DISTILLATION.items():
            if key in raw:
                raise ConfigurationError(f"{key} with trainer: distillation: {why}")
        return
    grpo_fields = {f.name for f in fields(_config_class("grpo")) if f.init}
    distillation_fields = {f.name for f in fields(_config_class("distillation")) if f.init} - grpo_fields
    for key in raw:
        if key in distillation_fields:
            raise ConfigurationError(
                f"{key} is a distillation field: add `trainer: distillation` to train on teachers alone "
                "(examples/distillation.yaml)"
            )
    if raw.get("teacher_server_urls") is not None and not raw.get("teacher_kl_coef"):
        raise ConfigurationError(
            "teacher_server_urls without teacher_kl_coef: a GRPO run weighs its teacher by teacher_kl_coef "
            "(examples/reward_and_teacher.yaml); to train on the teacher alone add `trainer: distillation` "
            "(examples/distillation.yaml)"
        )


def _teacher_models(raw: dict, teacher_urls: dict[str, str] | None) -> dict[str, str]:
    """`teacher_models`, checked: each id one of teacher_server_urls', each model a string."""
    models = expect(raw.get("teacher_models") or {}, dict, "teacher_models")
    for teacher_id, model in models.items():
        if teacher_id not in (teacher_urls or {}):
            known = ", ".join(teacher_urls or {}) or "none: set teacher_server_urls"
            raise ConfigurationError(
                f"teacher_models.{teacher_id}: no teacher {teacher_id!r} in teacher_server_urls "
                f"(its ids: {known})"
            )
        expect(model, str, f"teacher_models.{teacher_id}")
    return {str(teacher_id): model for teacher_id, model in models.items()}


def _training_arguments(raw: dict, config_class: type, arg_names: set[str], model: str):
    """The trainer's config (`config_class`) of the config's top-level fields, each checked against its
    type."""
    arg_types = typing.get_type_hints(config_class)
    arg_values = {}
    for name in arg_names & set(raw):
        value = raw[name]
        if isinstance(value, str) and accepts(arg_types[name], float) and not accepts(arg_types[name], str):
            value = float_from_text(value, name)  # YAML reads 1e-6 (no dot) as a string
        if not matches(value, arg_types[name]):
            raise ConfigurationError(
                f"{name}: expected {type_name(arg_types[name])}, got {type(value).__name__} {value!r}"
            )
        arg_values[name] = value
    # The trainer's own default output_dir: MODEL-AsyncGRPO, MODEL-AsyncDistillation.
    trainer_name = config_class.__name__.removesuffix("Config")
    arg_values.setdefault("output_dir", f"{Path(model).name or 'model'}-{trainer_name}")
    try:
        return config_class(**arg_values)
    except (ValueError, TypeError) as error:
        raise ConfigurationError(str(error)) from error


def _checked_datasets(raw: dict) -> tuple[dict | None, dict | None]:
    """The `dataset` and `eval_dataset` mappings (one dataset, or name -> dataset), checked."""
    dataset = raw.get("dataset")
    if dataset is not None:
        _check_dataset_spec(dataset, "dataset")
    eval_dataset = raw.get("eval_dataset")
    if eval_dataset is not None:
        expect(eval_dataset, dict, "eval_dataset")
        if _is_named_datasets(eval_dataset):
            for name, spec in eval_dataset.items():
                _check_dataset_spec(spec, f"eval_dataset.{name}")
        else:
            _check_dataset_spec(eval_dataset, "eval_dataset")
    return dataset, eval_dataset


def _environment_factory(raw: dict) -> Any:
    """`environment_factory` imported: one class, a name -> class mapping, or None."""
    environment = raw.get("environment_factory")
    if isinstance(environment, dict):
        return {name: resolve(path, f"environment_factory.{name}") for name, path in environment.items()}
    return None if environment is None else resolve(environment, "environment_factory")


def _loop_class(raw: dict) -> type | None:
    """`loop_class` imported and checked to be an AsyncRolloutLoop, or None."""
    if "loop_class" not in raw:
        return None
    loop_class = resolve(raw["loop_class"], "loop_class")
    from asyncgrpo.rollout.loop import AsyncRolloutLoop

    if not (isinstance(loop_class, type) and issubclass(loop_class, AsyncRolloutLoop)):
        raise ConfigurationError(f"loop_class {raw['loop_class']!r} is not a subclass of AsyncRolloutLoop")
    return loop_class


def _warm_start(raw: dict) -> dict | None:
    """`warm_start` with its function imported, or None."""
    warm_start = raw.get("warm_start")
    if warm_start is None:
        return None
    expect(warm_start, dict, "warm_start")
    _reject_unknown(warm_start, set(WARM_START_KEYS), "warm_start.")
    return {
        "function": resolve(warm_start.get("function"), "warm_start.function"),
        "kwargs": expect(warm_start.get("kwargs") or {}, dict, "warm_start.kwargs"),
    }


def _is_named_datasets(spec: dict) -> bool:
    """A mapping name -> dataset mapping (each evaluated under its name) rather than one dataset."""
    return (
        bool(spec) and not set(spec) & set(DATASET_KEYS) and all(isinstance(v, dict) for v in spec.values())
    )


def _check_dataset_spec(spec: Any, where: str) -> None:
    expect(spec, dict, where)
    _reject_unknown(spec, set(DATASET_KEYS), f"{where}.")
    if ("name" in spec) == ("data_files" in spec):
        raise ConfigurationError(
            f"{where}: give exactly one of `name` (a Hub id) or `data_files` (local files)"
        )
    if "columns" in spec:
        expect(spec["columns"], dict, f"{where}.columns")


def _harness(raw: dict) -> tuple[Any, Callable | None]:
    """(the harness session factory, the rollout reward function) of the config, or (None, None)."""
    spec = raw.get("harness_session_factory")
    if spec is None:
        for key in ("rollout_reward_fn", "harness_timeout_s"):
            if key in raw:
                raise ConfigurationError(f"{key} needs harness_session_factory (it is a harness setting)")
        return None, None
    clashing = [key for key in ("tools", "environment_factory", "loop_class") if key in raw]
    if clashing:
        raise ConfigurationError(
            f"harness_session_factory runs the agent's own loop: remove {', '.join(clashing)} (the agent "
            "brings its tools and its loop)"
        )
    reward_fn = resolve(raw["rollout_reward_fn"], "rollout_reward_fn") if "rollout_reward_fn" in raw else None
    if not isinstance(spec, dict):
        return resolve(spec, "harness_session_factory"), reward_fn
    _reject_unknown(spec, set(HARNESS_PROCESS_KEYS), "harness_session_factory.")
    command = expect(spec.get("command"), list, "harness_session_factory.command")
    if not command or not all(isinstance(part, str) for part in command):
        raise ConfigurationError(
            f"harness_session_factory.command: expected a list of strings, got {command!r}"
        )
    from asyncgrpo.harness import ProcessSessionFactory

    if command[0] in BARE_PYTHON_NAMES:
        command = [sys.executable, *command[1:]]
    options = {"command": command, "verify": resolve(spec.get("verify"), "harness_session_factory.verify")}
    if "timeout_s" in spec:
        options["timeout_s"] = float(spec["timeout_s"])
    if "env" in spec:
        options["env"] = {
            str(k): str(v) for k, v in expect(spec["env"], dict, "harness_session_factory.env").items()
        }
    if "agent_columns" in spec:
        options["agent_columns"] = expect(
            spec["agent_columns"], list, "harness_session_factory.agent_columns"
        )
    typed = {"max_agents": int, "agent_sandbox": str}
    typed |= {"agent_readable_paths": list, "agent_writable_paths": list}
    for key, kind in typed.items():
        if key in spec:
            options[key] = expect(spec[key], kind, f"harness_session_factory.{key}")
    if "agent_limits" in spec:
        where = "harness_session_factory.agent_limits"
        options["agent_limits"] = _sandbox_limits(expect(spec["agent_limits"], dict, where), where)
    return functools.partial(ProcessSessionFactory, **options), reward_fn


def _sandbox_limits(spec: dict, where: str) -> Any:
    from asyncgrpo.sandbox import SandboxLimits

    _reject_unknown(spec, {field.name for field in fields(SandboxLimits)}, f"{where}.")
    try:
        return SandboxLimits(**spec)
    except ValueError as error:
        raise ConfigurationError(f"{where}: {error}") from None


def resolve(path: Any, where: str) -> Any:
    """The object named by `module:attribute` (the attribute may be dotted)."""
    if not isinstance(path, str) or path.count(":") != 1:
        raise ConfigurationError(f"{where}: {path!r} is not an import path of the form module:attribute")
    module_name, attribute = path.split(":")
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # like `python -m`: the project's own modules import
    try:
        value = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise ConfigurationError(
            f"{where}: cannot import module {module_name!r} of {path!r} ({error})"
        ) from error
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise ConfigurationError(
                f"{where}: {module_name!r} has no attribute {attribute!r} (from {path!r})"
            )
        value = getattr(value, part)
    return value


def _reward_function(entry: Any, where: str) -> Callable:
    """A reward function: an import path, or {function: path of a factory, kwargs: its arguments} (a
    reward with settings, such as DAPO's overlong punishment)."""
    if not isinstance(entry, dict):
        return resolve(entry, where)
    _reject_unknown(entry, set(REWARD_FACTORY_KEYS), f"{where}.")
    factory = resolve(entry.get("function"), f"{where}.function")
    kwargs = expect(entry.get("kwargs") or {}, dict, f"{where}.kwargs")
    try:
        return factory(**kwargs)
    except (TypeError, ValueError) as error:
        raise ConfigurationError(f"{where}: {entry['function']}(**{kwargs!r}) failed: {error}") from error


def _reject_unknown(mapping: dict, valid: set[str], prefix: str) -> None:
    for key in mapping:
        if key not in valid:
            close = difflib.get_close_matches(str(key), sorted(valid), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(prefix + name for name in close)}?" if close else ""
            raise ConfigurationError(f"unknown key {prefix}{key}{hint}")


def _lora_config_keys() -> set[str]:
    try:
        from peft import LoraConfig
    except ModuleNotFoundError as error:
        raise ConfigurationError("peft_config needs peft: pip install 'asyncgrpo[peft]'") from error
    return {f.name for f in fields(LoraConfig) if f.init}


# -- building ---------------------------------------------------------------------------------------


def load_training_dataset(spec: dict, where: str = "dataset"):
    """The dataset a `dataset` mapping (or an `eval_dataset` one, named by `where`) describes."""
    from datasets import load_dataset

    split = spec.get("split", "train")
    if "name" in spec:
        dataset = load_dataset(spec["name"], spec.get("subset"), split=split)
    else:
        files = spec["data_files"]
        first = (
            files
            if isinstance(files, str)
            else next(iter(files.values() if isinstance(files, dict) else files))
        )
        first = first[0] if isinstance(first, list) else first
        builder = spec.get("format") or _FORMATS.get(Path(first).suffix)
        if builder is None:
            raise ConfigurationError(
                f"{where}.data_files: cannot tell the format of {first!r}; set {where}.format"
            )
        dataset = load_dataset(builder, data_files=files, split=split)
    columns = spec.get("columns") or {}
    missing = [name for name in columns if name not in dataset.column_names]
    if missing:
        raise ConfigurationError(
            f"{where}.columns: {missing} not among the dataset's columns {dataset.column_names}"
        )
    return dataset.rename_columns(columns) if columns else dataset


def load_eval_dataset(spec: dict):
    """The `eval_dataset` a config gives: one dataset, or a dict of named ones (the split defaults to
    train, as for `dataset`: name the held-out split, e.g. `split: test`)."""
    if _is_named_datasets(spec):
        return {name: load_training_dataset(part, f"eval_dataset.{name}") for name, part in spec.items()}
    return load_training_dataset(spec, "eval_dataset")


def build_trainer(run: RunConfig):
    """The AsyncGRPOTrainer the config describes (loads the model and the dataset, runs the warm start);
    a HarnessAsyncGRPOTrainer when it names a harness_session_factory, an AsyncDistillationTrainer with
    `trainer: distillation`."""
    from asyncgrpo import AsyncGRPOTrainer

    trainer_class = AsyncGRPOTrainer
    if run.loop_class is not None:
        trainer_class = type("ConfiguredAsyncGRPOTrainer", (AsyncGRPOTrainer,), {"loop_cls": run.loop_class})
    model = _warm_started_model(run)
    peft_config = None
    if run.peft_config is not None:
        from peft import LoraConfig

        peft_config = LoraConfig(**run.peft_config)
    if run.trainer == "distillation":
        from asyncgrpo import AsyncDistillationTrainer

        return AsyncDistillationTrainer(
            model=model,
            args=run.args,
            train_dataset=load_training_dataset(run.dataset) if run.dataset is not None else None,
            peft_config=peft_config,
            eval_dataset=load_eval_dataset(run.eval_dataset) if run.eval_dataset is not None else None,
        )
    if run.harness_session_factory is not None:
        from asyncgrpo import HarnessAsyncGRPOTrainer

        return HarnessAsyncGRPOTrainer(
            model=model,
            args=run.args,
            train_dataset=load_training_dataset(run.dataset) if run.dataset is not None else None,
            harness_session_factory=run.harness_session_factory,
            rollout_reward_fn=run.rollout_reward_fn,
            **({} if run.harness_timeout_s is None else {"harness_timeout_s": run.harness_timeout_s}),
            reward_funcs=run.reward_funcs or None,
            peft_config=peft_config,
            eval_dataset=load_eval_dataset(run.eval_dataset) if run.eval_dataset is not None else None,
        )
    return trainer_class(
        model=model,
        reward_funcs=run.reward_funcs or None,
        args=run.args,
        train_dataset=load_training_dataset(run.dataset) if run.dataset is not None else None,
        eval_dataset=load_eval_dataset(run.eval_dataset) if run.eval_dataset is not None else None,
        peft_config=peft_config,
        tools=run.tools or None,
        environment_factory=run.environment_factory,
    )


def _warm_started_model(run: RunConfig):
    """The model to train: its name, or with a warm start the model loaded and warm-started."""
    if run.warm_start is None:
        return run.model
    from transformers import AutoTokenizer

    from asyncgrpo import AsyncGRPOTrainer

    model = AsyncGRPOTrainer._load_model(run.model, run.args)
    tokenizer = AutoTokenizer.from_pretrained(run.model)
    result = run.warm_start["function"](model, tokenizer, **run.warm_start["kwargs"])
    print(f"warm start {run.raw['warm_start']['function']} done (it returned {result!r})", flush=True)
    return model
