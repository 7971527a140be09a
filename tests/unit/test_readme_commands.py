"""The README's commands, in order, as a new user types them.

Every line of the README's ```bash blocks is run here in the form a machine without a GPU or a
network can check, and a line this test cannot place fails it (a new README command needs a check):
- `asyncgrpo serve ...`: with `--dry-run`, which prints vLLM's command and starts nothing (the model
  is not downloaded; its config.json is read from the cache, offline here);
- `asyncgrpo train CONFIG ...`: with `--check`, which reads the config and its overrides and validates
  them, loading nothing;
- `asyncgrpo report RUN`: on a recorded run of the tiny model copied under RUN's name, which must be
  the run directory the train command before it writes (a real run needs the GPUs);
- `asyncgrpo export RUN/checkpoint-N OUT`: on the tiny model saved as that checkpoint;
- `python SCRIPT.py`: the README's Python block, compiled, its imports resolved and its trainer call
  bound to AsyncGRPOTrainer's signature (running it downloads a 2B model and a dataset);
- `make TARGET`: the Makefile has the target (`make test` is how this suite runs).
A synopsis (`asyncgrpo serve MODEL [--port 8000] ...`) is run with its required part only.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import shlex
import shutil
import tomllib
from pathlib import Path

import pytest

pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

from asyncgrpo.cli import main  # noqa: E402
from asyncgrpo.cli.tiny_model import save_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
RECORDED_RUN = ROOT / "tests" / "data" / "report_runs" / "healthy"
# What a synopsis's placeholders stand for here.
PLACEHOLDERS = {"MODEL": "Qwen/Qwen3.5-2B"}


def readme_commands() -> list[list[str]]:
    """The commands of the README's bash blocks in order: comments, a trailing `&` and leading
    environment assignments (`CUDA_VISIBLE_DEVICES=0`) left out."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.DOTALL):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                words.pop(0)
            if words and words[-1] == "&":
                words.pop()
            if words:
                commands.append(words)
    return commands


def required_part(words: list[str]) -> list[str]:
    """A synopsis without its optional `[...]` parts, placeholders filled in."""
    required, depth = [], 0
    for word in words:
        depth += word.count("[")
        if depth == 0:
            required.append(PLACEHOLDERS.get(word, word))
        depth -= word.count("]")
    unknown = [word for word in required if re.fullmatch(r"[A-Z][A-Z_]+", word)]
    assert not unknown, f"placeholders this test cannot fill: {unknown}"
    return required


def check_python_block(script: str) -> None:
    """The README's Python block: it compiles, what it imports exists, and its AsyncGRPOTrainer(...)
    call binds to the constructor's signature."""
    (block,) = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)[:1]
    tree = ast.parse(block, filename=script)
    compile(tree, script, "exec")
    imported = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{script}: {node.module} has no {alias.name}"
                imported[alias.asname or alias.name] = getattr(module, alias.name)
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "AsyncGRPOTrainer"
    ]
    assert calls, f"{script} builds no AsyncGRPOTrainer"
    for call in calls:
        signature = inspect.signature(imported["AsyncGRPOTrainer"])
        signature.bind(*[None] * len(call.args), **{keyword.arg: None for keyword in call.keywords})


def test_the_readme_commands_run_in_order(tmp_path, monkeypatch, capsys):
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["asyncgrpo"] == "asyncgrpo.cli:main"  # what `asyncgrpo` runs
    makefile = (ROOT / "Makefile").read_text()
    commands = readme_commands()
    assert len(commands) >= 8, commands
    checked, run_directory = [], None
    for words in commands:
        monkeypatch.chdir(ROOT)
        program, *rest = words
        if program == "asyncgrpo" and rest[0] == "serve":
            words = required_part(words)
            assert main([*words[1:], "--dry-run"]) == 0, words
            printed = capsys.readouterr().out.split()
            assert "serve" in printed and "--logprobs-mode" in printed, (words, printed)
        elif program == "asyncgrpo" and rest[0] == "train":
            assert main([*rest, "--check"]) == 0, (words, capsys.readouterr().out)
            (run_directory,) = re.findall(r"output_dir (\S+)\)", capsys.readouterr().out)
        elif program == "asyncgrpo" and rest[0] == "report":
            assert rest[1] == run_directory, "the report reads the run directory the train command writes"
            shutil.copytree(RECORDED_RUN, tmp_path / rest[1])
            monkeypatch.chdir(tmp_path)
            assert main(rest) == 0, words
            assert "report written to" in capsys.readouterr().out
            assert (tmp_path / rest[1] / "report.html").is_file()
        elif program == "asyncgrpo" and rest[0] == "export":
            assert rest[1].startswith(f"{run_directory}/checkpoint-"), "a checkpoint of the run trained above"
            save_tiny_model(tmp_path / rest[1])  # a checkpoint's model folder (its full layout)
            monkeypatch.chdir(tmp_path)
            assert main(rest) == 0, words
            assert "exported" in capsys.readouterr().out
            assert (tmp_path / rest[2] / "model.safetensors").is_file()
        elif program == "python" and len(rest) == 1 and rest[0].endswith(".py"):
            check_python_block(rest[0])
        elif program == "make" and len(rest) == 1:
            assert re.search(rf"^{re.escape(rest[0])}:", makefile, flags=re.MULTILINE), words
        else:
            pytest.fail(f"a README command this test cannot check: {shlex.join(words)}")
        checked.append(shlex.join(words))
    assert any("serve --for" in command for command in checked) and run_directory is not None
