"""Config-file runs: reading, overrides, validation errors, the server flags a config needs, and the
demo config trained through `asyncgrpo train` against a real vLLM server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

from asyncgrpo.cli import main
from asyncgrpo.cli.run_config import (
    build_run_config,
    load_eval_dataset,
    load_training_dataset,
    parse_overrides,
    read_config,
)
from asyncgrpo.cli.train_command import server_options_for
from asyncgrpo.errors import ConfigurationError

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
BASE = {
    "model": "m",
    "dataset": {"data_files": "x.jsonl"},
    "reward_funcs": "asyncgrpo.rewards:accuracy_reward",
}


def build(**changes):
    return build_run_config({**BASE, **changes})


@pytest.fixture(autouse=True)
def at_repo_root(monkeypatch):
    monkeypatch.chdir(REPO)  # configs name examples/... paths and modules relative to the repository


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_every_example_config_validates(path, capsys):
    assert main(["train", str(path.relative_to(REPO)), "--check"]) == 0
    assert "valid" in capsys.readouterr().out


# Tool calls that solve each example environment's task (what a trained policy would emit).
SOLUTIONS = {
    "TargetIncrementEnv": lambda env: [("increment", {"step": env.target})],
    "CodingEnv": lambda env: [
        ("run_code", {"code": f"a, b = 0, 1\nfor _ in range({env.n}):\n    a, b = b, a + b\nprint(a)"})
    ],
    "GameEnv": lambda env: [("move", {"action": "right"})] * 3 + [("move", {"action": "down"})] * 3,
}


@pytest.mark.parametrize("name", ["environment_dataset", "multiple_environments"])
def test_environment_examples_route_their_rows_and_score_a_solved_episode(name):
    from asyncgrpo.rollout.chat import tool_schema
    from asyncgrpo.rollout.environments import ROUTING_COLUMN, check_routing, environment_tools

    run = build_run_config(read_config(REPO / "examples" / f"{name}.yaml"))
    dataset = load_training_dataset(run.dataset)
    check_routing(run.environment_factory, dataset)
    factories = run.environment_factory
    for row in dataset:
        factory = factories[row[ROUTING_COLUMN]] if isinstance(factories, dict) else factories
        env = factory()
        columns = {key: value for key, value in row.items() if key not in ("prompt", ROUTING_COLUMN)}
        observation = env.reset(**columns)
        assert row.get("prompt") is not None or isinstance(observation, str)
        tools = {tool.__name__: tool for tool in environment_tools(env)}
        for tool in tools.values():  # a Google-style docstring: the model is told what each tool does
            assert tool_schema(tool)["function"]["description"]
        assert env.get_reward() == 0.0
        for tool_name, arguments in SOLUTIONS[type(env).__name__](env):
            tools[tool_name](**arguments)
        assert env.get_reward() == 1.0, (name, row)


def test_quickstart_config_is_the_deepmath_run():
    run = build_run_config(read_config(REPO / "examples" / "quickstart.yaml"))
    assert run.model == "Qwen/Qwen3.5-2B" and run.dataset == {
        "name": "trl-lib/DeepMath-103K",
        "split": "train",
    }
    assert [function.__name__ for function in run.reward_funcs] == ["accuracy_reward"]


def test_the_loss_menu_from_a_config_file(tmp_path):
    """TRL's GRPOConfig fields as YAML keys (a bool or a name for scale_rewards, a list of weights) and
    overrides; a reward function built by a factory with its keyword arguments (DAPO's recipe)."""
    run = build_run_config(read_config(REPO / "examples" / "dapo.yaml"))
    args = run.args
    assert (args.loss_type, args.epsilon_high, args.mask_truncated_completions) == ("dapo", 0.28, True)
    assert args.score_centering is False
    overlong = run.reward_funcs[1]
    assert overlong.__name__ == "soft_overlong_punishment_reward"
    assert overlong(completion_ids=[[1] * 1536, [1] * 2048]) == [0.0, -1.0]
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**BASE, "scale_rewards": False, "reward_weights": [2, 0.5]}))
    args = build_run_config(
        read_config(
            config, ["--loss_type", "grpo", "--importance_sampling_level", "sequence", "--beta", "0.04"]
        )
    ).args
    assert (args.scale_rewards, args.reward_weights, args.loss_type) == ("none", [2.0, 0.5], "grpo")
    assert (args.importance_sampling_level, args.beta) == ("sequence", 0.04)
    with pytest.raises(ConfigurationError, match="loss_type='gspo' is not a loss: pick one of grpo"):
        build(loss_type="gspo")
    with pytest.raises(ConfigurationError, match="reward_weights: expected list"):
        build(reward_weights="2,1")
    with pytest.raises(
        ConfigurationError, match=r"reward_funcs\[0\]: asyncgrpo.rewards:get_soft_overlong_punishment"
    ):
        build(
            reward_funcs=[{"function": "asyncgrpo.rewards:get_soft_overlong_punishment", "kwargs": {"x": 1}}]
        )
    with pytest.raises(ConfigurationError, match=r"unknown key reward_funcs\[0\]\.kwarg"):
        build(reward_funcs=[{"function": "asyncgrpo.rewards:get_soft_overlong_punishment", "kwarg": {}}])


def test_overrides_are_yaml_values_and_reach_into_sections(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(BASE))
    raw = read_config(
        config, ["--max-steps", "3", "--learning_rate=2e-5", "--dataset.split", "test", "--bf16", "false"]
    )
    assert (
        raw["max_steps"] == 3
        and raw["dataset"] == {"data_files": "x.jsonl", "split": "test"}
        and raw["bf16"] is False
    )
    run = build_run_config(raw)
    assert run.args.learning_rate == 2e-5 and run.args.max_steps == 3  # "2e-5" is a string to YAML
    with pytest.raises(ConfigurationError, match="--max_steps needs a value"):
        parse_overrides(["--max_steps"])
    with pytest.raises(ConfigurationError, match="expected --key value"):
        parse_overrides(["max_steps", "3"])


def test_unknown_keys_name_the_closest_valid_ones():
    with pytest.raises(ConfigurationError, match="unknown key max_stalenes; did you mean max_staleness"):
        build(max_stalenes=2)
    with pytest.raises(ConfigurationError, match="unknown key reward_func; did you mean reward_funcs"):
        build(reward_func="asyncgrpo.rewards:accuracy_reward")
    with pytest.raises(ConfigurationError, match="unknown key dataset.spilt; did you mean dataset.split"):
        build(dataset={"name": "d", "spilt": "train"})
    with pytest.raises(ConfigurationError, match="unknown key qwertyuiop$"):
        build(qwertyuiop=1)
    # LoraConfig's keywords are checked with the rest, not when the model is already loaded.
    with pytest.raises(
        ConfigurationError, match="unknown key peft_config.lora_alpah; did you mean peft_config.lora_alpha"
    ):
        build(peft_config={"r": 8, "lora_alpah": 16})


def test_wrong_types_name_the_expected_type():
    with pytest.raises(ConfigurationError, match="max_steps: expected int, got str 'many'"):
        build(max_steps="many")
    with pytest.raises(ConfigurationError, match="learning_rate: expected float, got str 'fast'"):
        build(learning_rate="fast")
    with pytest.raises(ConfigurationError, match="gradient_checkpointing: expected bool, got int 1"):
        build(gradient_checkpointing=1)
    with pytest.raises(ConfigurationError, match="dataset: expected dict"):
        build(dataset="trl-lib/DeepMath-103K")
    # AsyncGRPOConfig's own checks run too, with their message.
    with pytest.raises(ConfigurationError, match="num_generations=1"):
        build(num_generations=1)


def test_import_paths_that_do_not_resolve_say_which_part_failed():
    with pytest.raises(ConfigurationError, match=r"reward_funcs\[0\]: cannot import module 'no_such_module'"):
        build(reward_funcs="no_such_module:reward")
    with pytest.raises(
        ConfigurationError, match=r"reward_funcs\[1\]: 'asyncgrpo.rewards' has no attribute 'nope'"
    ):
        build(reward_funcs=["asyncgrpo.rewards:accuracy_reward", "asyncgrpo.rewards:nope"])
    with pytest.raises(
        ConfigurationError, match="tools\\[0\\]: 'asyncgrpo.rewards.accuracy_reward' is not an import path"
    ):
        build(tools=["asyncgrpo.rewards.accuracy_reward"])
    with pytest.raises(ConfigurationError, match="loop_class .* is not a subclass of AsyncRolloutLoop"):
        build(loop_class="asyncgrpo.rewards:accuracy_reward")


def test_missing_model_or_data_and_ambiguous_dataset():
    with pytest.raises(ConfigurationError, match="no `model`"):
        build_run_config({"dataset": {"name": "d"}})
    with pytest.raises(ConfigurationError, match="no `dataset`"):
        build_run_config({"model": "m"})
    with pytest.raises(ConfigurationError, match="exactly one of `name`"):
        build(dataset={"name": "d", "data_files": "x.jsonl"})


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_local_files_load_through_datasets_with_a_split_and_column_renames(tmp_path):
    rows = [{"question": f"q{i}", "solution": str(i)} for i in range(3)]
    train = write_rows(tmp_path / "train.jsonl", rows)
    test = write_rows(tmp_path / "held_out.jsonl", rows[:1])
    dataset = load_training_dataset(
        {"data_files": str(train), "columns": {"question": "prompt", "solution": "answer"}}
    )
    assert dataset.column_names == ["prompt", "answer"] and dataset["prompt"] == ["q0", "q1", "q2"]
    held_out = load_training_dataset(
        {"data_files": {"train": str(train), "test": str(test)}, "split": "test"}
    )
    assert held_out.num_rows == 1
    # The format comes from `format` when the extension does not tell it.
    (tmp_path / "rows.data").write_text(train.read_text())
    assert load_training_dataset({"data_files": str(tmp_path / "rows.data"), "format": "json"}).num_rows == 3
    with pytest.raises(
        ConfigurationError, match="cannot tell the format of .*rows.data.*; set dataset.format"
    ):
        load_training_dataset({"data_files": str(tmp_path / "rows.data")})
    with pytest.raises(
        ConfigurationError, match=r"dataset.columns: \['problem'\] not among the dataset's columns"
    ):
        load_training_dataset({"data_files": str(train), "columns": {"problem": "prompt"}})


def test_eval_dataset_is_one_dataset_or_named_ones(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(3)]
    held_out = write_rows(tmp_path / "held_out.jsonl", rows[:2])
    one = build(eval_dataset={"data_files": str(held_out)}, eval_strategy="steps", max_steps=4)
    assert one.args.eval_strategy == "steps"
    assert load_eval_dataset(one.eval_dataset).num_rows == 2
    named = build(eval_dataset={"easy": {"data_files": str(held_out)}, "all": {"data_files": str(held_out)}})
    loaded = load_eval_dataset(named.eval_dataset)
    assert sorted(loaded) == ["all", "easy"] and loaded["easy"].num_rows == 2
    with pytest.raises(ConfigurationError, match="eval_dataset.easy: give exactly one of `name`"):
        build(eval_dataset={"easy": {"split": "test"}})
    with pytest.raises(ConfigurationError, match="unknown key eval_dataset.spilt"):
        build(eval_dataset={"data_files": str(held_out), "spilt": "test"})
    with pytest.raises(ConfigurationError, match="set eval_dataset.format"):
        load_eval_dataset({"data_files": str(tmp_path / "rows.data")})


def test_a_dataset_name_goes_to_load_dataset_with_its_split(tmp_path):
    # `name` is what load_dataset takes: a Hub id, or (offline here) a directory laid out like one.
    rows = [{"prompt": f"p{i}"} for i in range(4)]
    write_rows(tmp_path / "hub" / "train.jsonl", rows)
    write_rows(tmp_path / "hub" / "test.jsonl", rows[:2])
    assert load_training_dataset({"name": str(tmp_path / "hub")}).num_rows == 4
    assert load_training_dataset({"name": str(tmp_path / "hub"), "split": "test"}).num_rows == 2


def test_cli_reports_config_errors_without_a_traceback(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({**BASE, "learning_rat": 1e-6}))
    assert main(["train", str(config)]) == 2
    assert "unknown key learning_rat; did you mean learning_rate" in capsys.readouterr().out
    config.write_text(yaml.safe_dump(BASE))
    assert main(["train", str(config), "--check", "--max-stalenes", "2"]) == 2  # overrides are checked too
    assert "unknown key max_stalenes; did you mean max_staleness" in capsys.readouterr().out


def test_server_flags_for_a_config():
    demo = server_options_for(build_run_config(read_config(REPO / "examples" / "demo.yaml")), cpu=True)
    assert (demo.model, demo.port, demo.max_model_len, demo.dtype) == (
        ".demo/tiny-model",
        8000,
        256,
        "float32",
    )
    assert not demo.enable_lora and demo.extra_args == []
    lora = server_options_for(
        build(peft_config={"r": 24}, max_staleness=3, vllm_server_base_url="http://h:9000")
    )
    assert (lora.enable_lora, lora.max_lora_rank, lora.max_loras, lora.host, lora.port) == (
        True,
        32,
        5,
        "h",
        9000,
    )
    sampled = server_options_for(build(top_p=0.9, top_k=64))
    assert "--return-sampling-mask" in sampled.extra_args
    # token_budget caps the server's length only when it is a budget (<= 0: rows of a sample count).
    assert server_options_for(build(token_budget=2048)).max_model_len == 2048
    assert server_options_for(build(token_budget=0)).max_model_len is None


def test_serve_for_prints_the_command_it_would_run(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the model's config is looked up: no Hub here
    assert (
        main(["serve", "--for", "examples/peft_lora.yaml", "--port", "8123", "--dry-run", "--seed", "1"]) == 0
    )
    command = capsys.readouterr().out
    assert "serve Qwen/Qwen3.5-2B" in command and "--port 8123" in command
    assert "--enable-lora --max-lora-rank 32 --max-loras 6" in command and command.strip().endswith(
        "--seed 1"
    )


def test_build_trainer_wires_what_the_config_names(tiny_model_dir, tmp_path):
    from asyncgrpo.cli.demo import correct_sum
    from asyncgrpo.cli.run_config import build_trainer
    from asyncgrpo.rollout.worker import check_worker_payload
    from examples.functions import CurriculumRolloutLoop, multiply

    raw = read_config(
        REPO / "examples" / "demo.yaml",
        ["--model", str(tiny_model_dir), "--output_dir", str(tmp_path / "run"), "--max_steps", "1"],
    )
    del raw["warm_start"]  # its supervised steps are the demo's, not what this test checks
    raw |= {
        "loop_class": "examples.functions:CurriculumRolloutLoop",
        "tools": ["examples.functions:multiply"],
        "dataset": {"data_files": "examples/data/addition.jsonl", "columns": {"answer": "solution"}},
        "eval_dataset": {"held_out": {"data_files": "examples/data/addition.jsonl"}},
        "eval_strategy": "steps",
    }
    trainer = build_trainer(build_run_config(raw))
    assert trainer.eval_dataset["held_out"].num_rows == 100 and trainer.args.eval_strategy == "steps"
    assert trainer.loop_cls is CurriculumRolloutLoop
    assert trainer.reward_funcs == [correct_sum] and trainer.tools == [multiply]
    assert trainer.train_dataset.num_rows == 100 and "solution" in trainer.train_dataset.column_names
    assert trainer.args.num_generations == 16 and trainer.args.max_steps == 1
    # What the rollout worker receives by pickling: everything named by import path must survive it.
    check_worker_payload(trainer.reward_funcs, trainer.loop_cls, trainer.tools, trainer.environment_factory)


def test_serve_for_runs_the_command_it_prints(capsys, monkeypatch):
    from asyncgrpo.generation.server import build_command, format_command

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = ["serve", "--for", "examples/top_k_top_p.yaml", "--dtype", "bfloat16", "--max-num-seqs", "64"]
    assert main([*argv, "--dry-run"]) == 0
    printed = capsys.readouterr().out.strip()
    served = []
    monkeypatch.setattr(
        "asyncgrpo.generation.server.serve_foreground", lambda options: served.append(options)
    )
    main(argv)
    assert "serving for examples/top_k_top_p.yaml" in capsys.readouterr().out
    assert format_command(*build_command(served[0])) == printed
    for flag in ("--max-model-len 4096", "--dtype bfloat16", "--return-sampling-mask", "--max-num-seqs 64"):
        assert flag in printed


@pytest.mark.vllm
def test_demo_config_trains_through_the_cli_and_fills_the_run_directory(
    vllm_server, tiny_model_dir, tmp_path, capsys
):
    from test_trainer_e2e import restore_server

    out = tmp_path / "run"
    argv = [
        "train",
        "examples/demo.yaml",
        "--model",
        str(tiny_model_dir),
        "--output_dir",
        str(out),
        "--vllm_server_base_url",
        vllm_server.url,
        "--max_steps",
        "3",
        "--warm_start.kwargs.known_max_steps",
        "50",
        "--num_generations",
        "4",
        "--vllm_server_timeout",
        "60",
    ]
    try:
        assert main(argv) == 0
    finally:
        restore_server(vllm_server.url, tiny_model_dir)
    printed = capsys.readouterr().out
    assert "step 3" in printed and "waiting:" in printed  # progress lines (pytest's stdout is not a TTY)
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["max_steps"] == 3 and resolved["warm_start"]["kwargs"] == {"known_max_steps": 50}
    assert json.loads((out / "config.json").read_text())["num_generations"] == 4
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    windows = [record for record in records if "train_runtime" not in record]
    assert [record["step"] for record in windows] == [1, 2, 3]
    assert all("reward" in record and "perf/step_s" in record for record in windows)
    assert (out / "warnings.log").exists()
    assert main(["report", str(out)]) == 0 and (out / "report.html").exists()


def test_the_harness_example_names_a_local_process_agent_and_its_verify(tmp_path):
    from asyncgrpo.harness import ProcessSessionFactory

    run = build_run_config(read_config(REPO / "examples" / "harness.yaml"))
    factory = run.harness_session_factory(sampling={"temperature": 1.0})
    assert isinstance(factory, ProcessSessionFactory) and factory.timeout_s == 120
    assert Path(factory.command[1]) == REPO / "examples" / "harness" / "file_agent.py"  # made absolute
    assert factory.command[0] == sys.executable, "`python` is the trainer's interpreter, not the PATH's"
    assert factory.verify_takes_row and factory.agent_columns == []  # the agent never sees the answer
    row = {"prompt": [], "answer": "42"}
    assert factory.verify(tmp_path, [], row) == 0.0
    (tmp_path / "answer.txt").write_text("7")
    (tmp_path / "task.json").write_text(json.dumps({"answer": "7"}))  # a forged key changes nothing
    assert factory.verify(tmp_path, [], row) == 0.0
    (tmp_path / "answer.txt").write_text("The answer is 42.")
    assert factory.verify(tmp_path, [], row) == 1.0
    (tmp_path / "answer.txt").write_text(" ".join(str(n) for n in range(100)))  # every number: not right
    assert factory.verify(tmp_path, [], row) == 0.0
    raw = read_config(REPO / "examples" / "harness.yaml")
    raw["harness_session_factory"].update(agent_columns=["hint"], max_agents=3)
    raw["harness_timeout_s"] = 60
    run = build_run_config(raw)
    factory = run.harness_session_factory(sampling={})
    assert factory.agent_columns == ["hint"] and factory.max_live_sessions == 3
    assert run.harness_timeout_s == 60.0


# What a user of this environment runs, in a fresh interpreter: the path holds this checkout and
# nothing else the tests might add.
PLAIN_HARNESS_USE = """
import sys
import openai  # what the example agent imports (the harness extra)
from asyncgrpo import HarnessAsyncGRPOTrainer
from asyncgrpo.harness import ProcessSessionFactory
from asyncgrpo.cli import main
assert main(["train", "examples/harness.yaml", "--check"]) == 0
assert "openenv" not in sys.modules, "the harness needs no OpenEnv"
"""


@pytest.mark.slow
def test_the_harness_and_its_example_config_load_in_the_environment_as_installed():
    done = subprocess.run(
        [sys.executable, "-c", PLAIN_HARNESS_USE],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "examples/harness.yaml: valid" in done.stdout


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"harness_session_factory": "examples.functions:IncrementEnv", "tools": []}, "remove tools"),
        ({"rollout_reward_fn": "examples.functions:math_reward_func"}, "needs harness_session_factory"),
        ({"harness_timeout_s": 60}, "needs harness_session_factory"),
        ({"harness_session_factory": {"command": ["a"], "verify": "x:y", "timeout": 3}}, "timeout"),
        ({"harness_session_factory": {"command": "python agent.py", "verify": "x:y"}}, "command"),
    ],
)
def test_bad_harness_settings_are_refused(changes, message):
    with pytest.raises(ConfigurationError, match=message):
        build(**changes)


def test_build_trainer_gives_a_harness_run_its_eval_dataset(tiny_model_dir, tmp_path):
    from asyncgrpo import HarnessAsyncGRPOTrainer
    from asyncgrpo.cli.run_config import build_trainer

    raw = read_config(
        REPO / "examples" / "harness.yaml",
        ["--model", str(tiny_model_dir), "--output_dir", str(tmp_path / "run"), "--max_steps", "1"],
    )
    raw["eval_dataset"] = {"data_files": "examples/harness/notes.jsonl"}
    trainer = build_trainer(build_run_config(raw))
    assert isinstance(trainer, HarnessAsyncGRPOTrainer)
    assert trainer.eval_dataset.num_rows == trainer.train_dataset.num_rows > 0


def test_the_harness_keys_of_a_config_set_the_agents_sandbox(tmp_path):
    from asyncgrpo.sandbox import SandboxLimits

    spec = yaml.safe_load((REPO / "examples" / "harness.yaml").read_text())
    spec["harness_session_factory"] |= {
        "agent_limits": {"memory_bytes": 2**30, "processes": 64},
        "agent_readable_paths": [str(tmp_path)],
        "agent_writable_paths": [str(tmp_path)],
    }
    factory = build_run_config(spec).harness_session_factory(sampling={})
    assert factory.sandbox.limits == SandboxLimits(memory_bytes=2**30, processes=64)
    assert factory.sandbox.readable_paths == factory.sandbox.writable_paths == (str(tmp_path),)
    spec["harness_session_factory"]["agent_limits"] = {"memory": 1}
    with pytest.raises(ConfigurationError, match="unknown key harness_session_factory.agent_limits.memory"):
        build_run_config(spec)
    spec["harness_session_factory"]["agent_limits"] = {"processes": 0}
    with pytest.raises(
        ConfigurationError, match=r"agent_limits: SandboxLimits.processes=0 must be a positive"
    ):
        build_run_config(spec)


DISTILLATION = {
    "trainer": "distillation",
    "model": "m",
    "dataset": {"data_files": "examples/data/addition.jsonl"},
    "teacher_server_urls": {"math": "http://localhost:8001", "code": "http://localhost:8002"},
}


def test_a_distillation_config_builds_an_async_distillation_config_with_trls_field_names():
    from asyncgrpo import AsyncDistillationConfig

    trl_fields = {"beta": 0.5, "teacher_temperature": 0.7, "teacher_top_k": 16, "add_tail_bucket": False}
    run = build_run_config({**DISTILLATION, **trl_fields, "teacher_models": {"math": "big/math"}})
    assert type(run.args) is AsyncDistillationConfig and run.trainer == "distillation"
    assert {name: getattr(run.args, name) for name in trl_fields} == trl_fields
    assert run.args.teacher_server_urls == DISTILLATION["teacher_server_urls"]
    assert run.args.num_generations == 1 and run.args.output_dir == "m-AsyncDistillation"  # TRL's defaults
    assert run.reward_funcs == [] and run.teacher_models == {"math": "big/math"}
    # A GRPO config is unchanged: the trainer key defaults to grpo.
    assert build(trainer="grpo").trainer == build().trainer == "grpo"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"teacher_topk": 3}, "unknown key teacher_topk; did you mean teacher_top_k"),
        ({"teacher_top_k": "eight"}, "teacher_top_k: expected int, got str 'eight'"),
        ({"teacher_top_k": 0}, "teacher_top_k=0 must be >= 1"),
        ({"teacher_temperature": 0}, "teacher_temperature=0 must be > 0"),
        ({"beta": 1.5}, r"beta=1.5 must be in \[0, 1\]"),
        ({"teacher_server_urls": {"math": "localhost:8001"}}, r"teacher_server_urls\['math'\]"),
        ({"teacher_models": {"physics": "big/physics"}}, "teacher_models.physics: no teacher 'physics'"),
        ({"teacher_models": {"math": 7}}, "teacher_models.math: expected str"),
        ({"teacher_kl_coef": 0.1}, "teacher_kl_coef=0.1: the teacher term is GRPO's"),
        ({"trainer": "dpo"}, "trainer: expected one of grpo, distillation, got 'dpo'"),
    ],
)
def test_bad_teacher_settings_are_refused_naming_the_field(changes, message):
    with pytest.raises(ConfigurationError, match=message):
        build_run_config({**DISTILLATION, **changes})


@pytest.mark.parametrize(
    "key, value, why",
    [
        ("reward_funcs", "asyncgrpo.rewards:accuracy_reward", "takes no reward functions.*teacher_kl_coef"),
        ("tools", ["examples.functions:multiply"], "takes no tools"),
        ("harness_session_factory", "examples.functions:multiply", "HarnessAsyncGRPOTrainer"),
    ],
)
def test_a_distillation_config_refuses_what_distillation_cannot_use(key, value, why):
    with pytest.raises(ConfigurationError, match=f"{key} with trainer: distillation: .*{why}"):
        build_run_config({**DISTILLATION, key: value})


def test_distillation_is_asked_for_by_the_trainer_key_not_by_its_fields():
    with pytest.raises(ConfigurationError, match="add_tail_bucket is a distillation field: add `trainer: "):
        build(add_tail_bucket=False)
    with pytest.raises(ConfigurationError, match="without teacher_kl_coef.*add `trainer: distillation`"):
        build(teacher_server_urls="http://localhost:8001")
    assert build(teacher_server_urls="http://localhost:8001", teacher_kl_coef=0.1).args.teacher_kl_coef == 0.1


def test_train_runs_a_distillation_config_through_the_distillation_trainer(monkeypatch, tmp_path, capsys):
    import asyncgrpo

    built = []

    class RecordingTrainer:  # stands in for the real one, which asks its teachers for their tokenizers
        def __init__(self, **kwargs):
            built.append(kwargs)

        def train(self, resume_from_checkpoint=None):
            pass

    monkeypatch.setattr(asyncgrpo, "AsyncDistillationTrainer", RecordingTrainer, raising=False)
    local = "{data_files: examples/data/addition.jsonl}"  # the example's Hub dataset, without the Hub
    argv = ["train", "examples/distillation.yaml", "--output_dir", str(tmp_path / "run"), "--dataset", local]
    argv += ["--eval_dataset", local]  # evaluated as a GRPO run's: the teachers score its completions
    on_sigterm = signal.getsignal(signal.SIGTERM)
    try:
        assert main(argv) == 0
    finally:
        signal.signal(signal.SIGTERM, on_sigterm)  # `train` makes SIGTERM unwind like Ctrl-C
    (kwargs,) = built
    assert type(kwargs["args"]).__name__ == "AsyncDistillationConfig" and "reward_funcs" not in kwargs
    assert kwargs["train_dataset"].num_rows == kwargs["eval_dataset"].num_rows == 100
    assert kwargs["model"] == "Qwen/Qwen3.5-2B" and kwargs["args"].teacher_server_urls == {
        "default": "http://localhost:8001"
    }
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["trainer"] == "distillation"
    assert f"run directory: {tmp_path / 'run'}" in capsys.readouterr().out
