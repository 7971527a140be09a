"""The trainer is composed, not stacked (docs/architecture.md, "The trainer's modules"): read from the
source with `ast`, asyncgrpo/trainer/ has no import cycle (imports made only for type checking
included), no function over 80 lines and no module over 600, and AsyncGRPOTrainer has no base class
of its own beside transformers' Trainer."""

from __future__ import annotations

import ast
from pathlib import Path

TRAINER = Path(__file__).resolve().parent.parent / "asyncgrpo" / "trainer"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 600


def trainer_imports() -> dict[str, set[str]]:
    """module -> the trainer modules it imports, anywhere in its source (TYPE_CHECKING blocks too)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(TRAINER.glob("*.py")):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith("asyncgrpo.trainer."):
                    imported.add(node.module.split(".")[2])
                elif node.module == "asyncgrpo.trainer":
                    imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.Import):
                imported.update(
                    alias.name.split(".")[2]
                    for alias in node.names
                    if alias.name.startswith("asyncgrpo.trainer.")
                )
        graph[path.stem] = imported
    return graph


def cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A path of imports from `start` back to itself, or None."""
    stack, seen = [(start, [start])], set()
    while stack:
        module, path = stack.pop()
        for imported in sorted(graph.get(module, ())):
            if imported == start:
                return path + [start]
            if imported not in seen:
                seen.add(imported)
                stack.append((imported, path + [imported]))
    return None


def test_no_import_cycle_inside_the_trainer_type_checking_imports_included():
    graph = trainer_imports()
    cycles = [cycle for module in graph if (cycle := cycle_from(module, graph))]
    assert not cycles, [" -> ".join(cycle) for cycle in cycles]


def test_no_trainer_function_over_80_lines_and_no_module_over_600():
    long_functions, long_modules = [], []
    for path in sorted(TRAINER.glob("*.py")):
        source = path.read_text()
        if len(source.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{path.name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.name}:{node.lineno} {node.name}: {lines} lines")
    assert not long_functions, long_functions
    assert not long_modules, long_modules


def test_the_trainer_stacks_no_mixin_and_its_run_state_lives_in_the_per_run_object():
    from transformers import Trainer

    from asyncgrpo.trainer.async_grpo_trainer import AsyncGRPOTrainer
    from asyncgrpo.trainer.training_run import TrainingRun

    assert AsyncGRPOTrainer.__bases__ == (Trainer,)
    fields = set(TrainingRun.__dataclass_fields__)
    assert {
        "processes",
        "ledger",
        "metrics",
        "session",
        "timeline",
        "served_step",
        "nonfinite_streak",
    } <= fields
    # The run's counters are assigned in the per-run object's module alone.
    for path in sorted(TRAINER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in ("served_step", "nonfinite_streak"):
                    where = f"{path.name}:{node.lineno}"
                    assert path.name == "training_run.py", where
