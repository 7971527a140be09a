"""The package's layers (docs/architecture.md, "Layers"): every import of one part of asyncgrpo by
another goes down the layers, and no module imports itself back through others. Read from the
source with `ast`, so imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "asyncgrpo"

# A part is a subpackage or a module at the package's root; "asyncgrpo" is the root `__init__` (the
# public API). A part may import parts of lower layers only (and itself).
LAYERS: list[set[str]] = [
    {"errors"},
    {"run"},
    {"records", "modeling", "sandbox"},
    {"config", "kernels", "packing", "generation", "checkpoints"},
    {"losses"},
    {"rollout", "weight_sync"},
    {"rewards", "harness"},
    {"trainer"},
    {"asyncgrpo"},
    {"report"},
    {"cli"},
]
LAYER_OF = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "asyncgrpo"


def runtime_nodes(tree: ast.AST, with_type_checking: bool):
    """Every node of `tree`, leaving out `if TYPE_CHECKING:` blocks unless `with_type_checking`."""
    for node in ast.iter_child_nodes(tree):
        if not with_type_checking and isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            continue
        yield node
        yield from runtime_nodes(node, with_type_checking)


def imported_modules(path: Path, modules: set[str], with_type_checking: bool) -> set[str]:
    """The asyncgrpo modules `path` imports, anywhere in it (`from asyncgrpo import x` names module
    `asyncgrpo.x` when it is one, the root package otherwise)."""
    found = set()
    for node in runtime_nodes(ast.parse(path.read_text(encoding="utf-8")), with_type_checking):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "asyncgrpo"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "asyncgrpo":
                continue
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in modules else node.module)
    return found


def import_graph(with_type_checking: bool = True) -> dict[str, set[str]]:
    """module -> the asyncgrpo modules it imports; `with_type_checking`: imports made for type checkers
    alone count too (a type is a dependency too: for the layers and for cycles)."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {
        module: imported_modules(path, modules, with_type_checking) - {module}
        for module, path in paths.items()
    }


def test_every_part_has_a_layer():
    parts = {part_of(module) for module in import_graph()}
    assert parts <= set(LAYER_OF), f"parts without a layer in LAYERS: {sorted(parts - set(LAYER_OF))}"


def test_imports_go_down_the_layers():
    upward = [
        f"{module} imports {target} ({part_of(module)} is layer {LAYER_OF[part_of(module)]}, "
        f"{part_of(target)} is layer {LAYER_OF[part_of(target)]})"
        for module, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if part_of(target) != part_of(module) and LAYER_OF[part_of(target)] >= LAYER_OF[part_of(module)]
    ]
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def ancestors(module: str) -> list[str]:
    """The packages above `module`: `a.b.c` -> [a.b, a]. Importing a module runs their __init__
    first, so an import of `asyncgrpo.rollout.loop` is not an import of the root's public API."""
    parts = module.split(".")
    return [".".join(parts[:end]) for end in range(len(parts) - 1, 0, -1)]


def test_no_module_imports_itself_back():
    # Imports made for type checkers alone count: a circle of types is a circle a reader follows too.
    graph = import_graph(with_type_checking=True)
    # A package's __init__ runs before its modules: a module importing a sibling through the package
    # is not a cycle with the package itself, so edges to a module's own ancestors are left out.
    pruned = {module: {t for t in targets if t not in ancestors(module)} for module, targets in graph.items()}
    assert find_cycle(pruned) is None, f"import cycle: {' -> '.join(find_cycle(pruned))}"


def test_the_checks_catch_what_they_guard():
    # The layer check and the cycle search on planted graphs: an upward import and a cycle are found.
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert LAYER_OF["trainer"] > LAYER_OF["weight_sync"] > LAYER_OF["generation"] > LAYER_OF["records"]


# One concept per module keeps a module short enough to read whole: past this many lines, a module holds
# more than one concept and is split by concern (docs/architecture.md, "Layers").
MAX_MODULE_LINES = 600


def test_no_module_outgrows_one_concept():
    long = {
        str(path.relative_to(PACKAGE.parent)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {long}"


# A function longer than this does more than one named step: it is split into steps that each read
# whole (docs/architecture.md, "Layers").
MAX_FUNCTION_LINES = 80


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in `source` longer than `limit` lines."""
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_function_outgrows_its_steps():
    long = {
        f"{path.relative_to(PACKAGE.parent)}:{name}": lines
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, lines in long_functions(path.read_text(encoding="utf-8"), MAX_FUNCTION_LINES)
    }
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {long}"
    planted = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    assert long_functions(planted, MAX_FUNCTION_LINES) == [("f", MAX_FUNCTION_LINES + 1)]


# tests/ holds the suite's folders by kind (docs/testing.md): unit, integration, gpu, support.
MAX_LOOSE_TEST_FILES = 10


def test_tests_are_sorted_by_kind():
    tests = Path(__file__).resolve().parents[1]
    loose = sorted(path.name for path in tests.glob("*.py"))
    assert len(loose) <= MAX_LOOSE_TEST_FILES, (
        f"files directly in tests/ (sort them into its folders): {loose}"
    )
    for kind in ("unit", "integration", "gpu", "support"):
        assert (tests / kind).is_dir(), f"tests/{kind} is missing"
