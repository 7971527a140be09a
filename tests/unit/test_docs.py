"""The repository explains itself: every setting and every logged metric is documented in docs/,
links inside docs/ resolve, and code and tests point to docs/ rather than to documents that are not
in the repository."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from asyncgrpo.config import AsyncGRPOConfig

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def python_sources(*folders: str) -> list[Path]:
    return sorted(path for folder in folders for path in (ROOT / folder).rglob("*.py"))


def own_config_fields() -> set[str]:
    """The fields asyncgrpo declares (its groups of fields in asyncgrpo/config/ and TRL's compatibility
    fields), as opposed to those TrainingArguments declares and asyncgrpo leaves alone."""
    return {
        name
        for cls in AsyncGRPOConfig.__mro__
        if cls.__module__.startswith("asyncgrpo.")
        for name in vars(cls).get("__annotations__", {})
    }


def test_every_config_field_has_help_text_and_a_documented_entry():
    configuration = (DOCS / "configuration.md").read_text()
    own = own_config_fields()
    assert {"num_generations", "max_inflight_tasks", "logging_steps", "eval_pass_threshold"} <= own
    fields = [field for field in dataclasses.fields(AsyncGRPOConfig) if field.name in own]
    assert len(fields) == len(own)
    missing_help = [field.name for field in fields if not field.metadata.get("help")]
    undocumented = [field.name for field in fields if f"`{field.name}`" not in configuration]
    assert not missing_help, f"fields without help text: {missing_help}"
    assert not undocumented, f"fields missing from docs/configuration.md: {undocumented}"


# A unit for every numeric field: what its number counts.
_UNIT = re.compile(
    r"\b(tokens?|seconds?|rollouts?|steps?|versions?|ratio|fraction|factor|mass|probability|turns?|samples?"
    r"|half-width|coefficient|log-probs|MiB)\b",
    flags=re.IGNORECASE,
)


def _names_its_default(help_text: str, default) -> bool:
    if isinstance(default, bool) or default is None:
        return str(default) in help_text
    if isinstance(default, (int, float)):
        numbers = re.findall(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e-?\d+)?", help_text)
        return any(float(number) == float(default) for number in numbers)
    return str(default) in help_text


def test_every_config_field_says_its_default_and_its_unit():
    """Help text says what, unit and why the default: the default is named (and, by the convention
    `8: why` or `None: what it means`, followed by its reason), and a number says what it counts."""
    own = own_config_fields()
    fields = [field for field in dataclasses.fields(AsyncGRPOConfig) if field.name in own]
    silent = [f.name for f in fields if not _names_its_default(f.metadata["help"], f.default)]
    assert not silent, f"help text that does not name its default: {silent}"
    numeric = [f for f in fields if re.search(r"\b(int|float)\b", str(f.type))]
    assert len(numeric) > 20
    unitless = [f.name for f in numeric if not _UNIT.search(f.metadata["help"])]
    assert not unitless, f"numeric fields whose help text names no unit: {unitless}"


def _text(node: ast.AST) -> str | None:
    """A string literal's text; an f-string's with each placeholder written `{}`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)
    return None


def _is_stat(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Stat"


def recorded_metric_names() -> dict[str, str]:
    """Every metric name the package logs, with where: the first argument of record/record_rate/add,
    the keys of a dict of `Stat`s (the loss's metrics), `metrics["name"] = Stat(...)`, and the keys
    of a dict handed to `self.log`. Placeholders are written `{}` (`rewards/{}/mean`)."""
    names: dict[str, str] = {}
    for path in python_sources("asyncgrpo"):
        where = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            found: list[ast.AST] = []
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
                if node.func.attr in ("record", "record_rate", "add"):
                    found.append(node.args[0])
            if isinstance(node, ast.Dict) and node.values and all(_is_stat(v) for v in node.values):
                found.extend(node.keys)
            if isinstance(node, ast.Assign) and _is_stat(node.value):
                found.extend(t.slice for t in node.targets if isinstance(t, ast.Subscript))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                dicts = {
                    a.targets[0].id: a.value
                    for a in ast.walk(node)
                    if isinstance(a, ast.Assign)
                    and isinstance(a.value, ast.Dict)
                    and len(a.targets) == 1
                    and isinstance(a.targets[0], ast.Name)
                }
                for call in ast.walk(node):
                    if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "log" and call.args:
                        logged = call.args[0]
                        logged = dicts.get(logged.id) if isinstance(logged, ast.Name) else logged
                        if isinstance(logged, ast.Dict):
                            found.extend(logged.keys)
            for key in found:
                name = _text(key) if key is not None else None
                if name:
                    names.setdefault(name, f"{where}:{key.lineno}")
    names.update(evaluation_figure_names())
    return names


# Where an evaluation's figures are named, unprefixed: the trainer logs each as `eval_` + the name.
EVALUATION_SOURCES = ("asyncgrpo/rollout/eval_metrics.py", "asyncgrpo/trainer/evaluator.py")


def evaluation_figure_names() -> dict[str, str]:
    """`eval_` + every key given to a `figures` or `measured` dict in the evaluation's modules
    (`figures = {...}`, `measured["runtime"] = ...`), with where."""
    names: dict[str, str] = {}
    for source in EVALUATION_SOURCES:
        for node in ast.walk(ast.parse((ROOT / source).read_text())):
            if not isinstance(node, ast.Assign) or len(node.targets) != 1:
                continue
            target = node.targets[0]
            keys: list[ast.AST] = []
            if isinstance(target, ast.Name) and target.id == "figures" and isinstance(node.value, ast.Dict):
                keys = list(node.value.keys)
            elif isinstance(target, ast.Subscript) and getattr(target.value, "id", None) in (
                "figures",
                "measured",
            ):
                keys = [target.slice]
            for key in keys:
                name = _text(key)
                if name:
                    names.setdefault(f"eval_{name}", f"{source}:{key.lineno}")
    return names


def _placeholders_blank(name: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", name)


# Names the base Trainer's `log` adds to every log it writes (AsyncGRPOTrainer logs through it).
BASE_TRAINER_LOGS = ("epoch", "num_input_tokens_seen")


def logged_metric_names() -> set[str]:
    """Every name a run can log, placeholders blank: the package's records and the base Trainer's."""
    import inspect

    from transformers import Trainer

    base_log = inspect.getsource(Trainer.log)
    assert all(f'logs["{name}"]' in base_log for name in BASE_TRAINER_LOGS), "transformers changed"
    return {_placeholders_blank(name) for name in recorded_metric_names()} | set(BASE_TRAINER_LOGS)


def documented_metric_names() -> tuple[set[str], set[str]]:
    """(every backticked name in docs/metrics.md, the names its tables define in their first column)."""
    reference = (DOCS / "metrics.md").read_text()
    mentioned = {_placeholders_blank(n) for n in re.findall(r"`([^`\s]+)`", reference)}
    defined = {
        _placeholders_blank(name)
        for line in reference.splitlines()
        if line.startswith("| `")
        for name in re.findall(r"`([^`]+)`", line.split("|")[1])
    }
    return mentioned, defined


def test_every_recorded_metric_is_in_the_metric_reference():
    recorded = {_placeholders_blank(name): where for name, where in recorded_metric_names().items()}
    # The extraction reaches every way the code logs: record(), a dict of Stats, a subscript, self.log.
    reached = {"loss", "entropy", "aux_loss", "train_runtime", "tools/{}/latency_s", "rewards/{}/mean"}
    reached |= {"eval_reward", "eval_pass@{}", "eval_rewards/{}/mean", "eval_runtime"}
    assert reached <= set(recorded), sorted(reached - set(recorded))
    mentioned, defined = documented_metric_names()
    undocumented = sorted(f"{name} ({where})" for name, where in recorded.items() if name not in mentioned)
    assert not undocumented, f"metrics missing from docs/metrics.md: {undocumented}"
    assert set(BASE_TRAINER_LOGS) <= mentioned, "the base Trainer's names are logged too"
    never_logged = sorted(defined - logged_metric_names())
    assert not never_logged, f"docs/metrics.md describes metrics the code never logs: {never_logged}"


# Metric names of TRL 1.16 that asyncgrpo logs under another name or not at all, as
# docs/trl-compatibility.md and the README mention them (placeholders blank). Anything else a doc names
# must be logged by this code.
TRL_ONLY_METRICS = {
    "reward_std", "rewards/{}", "ratio",
    "perf/mfu_fwd_bwd", "perf/mfu_wall_clock", "perf/forwarded_tok_s_fwd_bwd",
    "perf/forwarded_tok_s_wall_clock", "perf/trained_tok_s_wall_clock",
    "rollout/generated_tok_s", "rollout/inflight", "rollout/vllm_retry_total", "rollout/realign_frac",
    "sample/dropped_stale_total", "sample/rollout_queue_size",
    "batch/dropped_oversize_total", "tools/unknown_name_total", "tools/{}/call_total",
    "tools/{}/failure_total",
}  # fmt: skip


def _names_a_logged_metric(name: str, logged: set[str]) -> bool:
    """`name` (placeholders blank) is logged: exactly, as an instance of a placeholder
    (`rewards/IncrementEnv/mean`), or, with `*`, as a pattern some logged name fits."""
    if name in logged:
        return True
    pattern = re.escape(name).replace(r"\*", ".*").replace(r"\{\}", "[^/]+")
    return any(
        re.fullmatch(pattern, metric) or re.fullmatch(re.escape(metric).replace(r"\{\}", "[^/]+"), name)
        for metric in logged
    )


def _metric_passages() -> dict[str, str]:
    """Where the docs map metric names one to one: there every backquoted name is a metric (or a
    setting), short names like `reward` or `kl` included."""
    compatibility = (DOCS / "trl-compatibility.md").read_text()
    section = compatibility[compatibility.index("## Metric names") :]
    readme = (ROOT / "README.md").read_text()
    bullet = readme[readme.index("- Metric names") + 1 :]  # to the next bullet or paragraph
    return {
        "docs/trl-compatibility.md (Metric names)": section[: section.index("\n## ")],
        "README.md (Coming from TRL)": bullet[: min(bullet.index("\n- "), bullet.index("\n\n"))],
    }


def unknown_metric_names(documents: dict[str, str], passages: dict[str, str]) -> list[str]:
    """Backquoted metric names that neither this code logs nor TRL's list above names: a metric
    name (`part/...` with a metric namespace) anywhere in `documents`, any name in `passages`."""
    logged = logged_metric_names()
    # A backquoted `part/...` whose first part starts some logged name (`rollout/`, `tools/`) is a metric.
    namespaces = {name.split("/")[0] for name in logged if "/" in name}
    settings = {field.name for field in dataclasses.fields(AsyncGRPOConfig)}
    unknown = []
    for where, text in [*documents.items(), *passages.items()]:
        in_passage = where in passages
        for quoted in re.findall(r"`([^`\s]+)`", text):
            name = _placeholders_blank(quoted)
            if "." in name or name.startswith(("_", "/")):
                continue  # a file, a fragment (`/min`, `_count`)
            if not in_passage and ("/" not in name or name.split("/")[0] not in namespaces):
                continue
            if name in settings or name in TRL_ONLY_METRICS or _names_a_logged_metric(name, logged):
                continue
            unknown.append(f"{where}: {quoted}")
    return unknown


def _documents() -> dict[str, str]:
    pages = {f"docs/{path.name}": path.read_text() for path in sorted(DOCS.glob("*.md"))}
    return {**pages, "README.md": (ROOT / "README.md").read_text()}


def test_every_metric_a_doc_names_is_logged_or_is_trls():
    logged = logged_metric_names()
    assert not TRL_ONLY_METRICS & logged, "a name listed as TRL's own is logged here"
    passages = _metric_passages()
    assert all(len(text) > 200 for text in passages.values()), passages.keys()
    unknown = unknown_metric_names(_documents(), passages)
    assert not unknown, f"metric names the docs mention that nothing logs: {unknown}"


def test_the_metric_name_check_catches_a_made_up_name():
    """The check above is not vacuous: a name nothing logs fails it, wherever a doc puts it."""
    documents = {"docs/page.md": "watch `rollout/made_up_frac` and `tools/{name}/latency_s`"}
    passages = {"docs/table.md": "| `reward_stdev` | `reward_group_std` | `rewards/IncrementEnv/mean` |"}
    assert unknown_metric_names(documents, passages) == [
        "docs/page.md: rollout/made_up_frac",
        "docs/table.md: reward_stdev",
    ]


def test_every_field_the_configuration_page_lists_exists():
    """The first column of every table of docs/configuration.md names config fields (TrainingArguments'
    included), each of which must exist; and every field asyncgrpo declares is on the page."""
    configuration = (DOCS / "configuration.md").read_text()
    fields = {field.name for field in dataclasses.fields(AsyncGRPOConfig)}
    listed = {
        name
        for line in configuration.splitlines()
        if line.startswith("| `")
        for name in re.findall(r"`([^`]+)`", line.split("|")[1])
    }
    assert len(listed) > 40
    assert not listed - fields, f"docs/configuration.md lists fields AsyncGRPOConfig lacks: {listed - fields}"
    own = own_config_fields()
    missing = sorted(name for name in own if f"`{name}`" not in configuration)
    assert not missing, f"fields missing from docs/configuration.md: {missing}"


def test_every_metric_row_says_what_it_means_and_what_is_healthy():
    rows = [line for line in (DOCS / "metrics.md").read_text().splitlines() if line.startswith("| `")]
    assert len(rows) > 80
    cells = [[cell.strip() for cell in row.split("|")[1:-1]] for row in rows]
    incomplete = [row[0] for row in cells if len(row) != 4 or not all(row)]
    assert not incomplete, f"metric rows without a reduction, meaning or healthy value: {incomplete}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("page", sorted(path.name for path in DOCS.glob("*.md")))
def test_links_in_docs_resolve(page):
    text = (DOCS / page).read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (DOCS / file_part) if file_part else DOCS / page
        assert linked.exists(), f"{page}: link to missing {target}"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.MULTILINE)
            assert anchor in {_anchor(h) for h in headings}, f"{page}: no heading for #{anchor}"


# Everything shipped that a reader opens: code, tests, docs, benchmarks and their results, examples.
_SHIPPED_FOLDERS = ("asyncgrpo", "tests", "docs", "bench", "examples", "scripts")
_SHIPPED_FILES = ("README.md", "Makefile", "pyproject.toml")
_TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".json", ".jsonl"}


def shipped_text_files() -> list[Path]:
    files = [ROOT / name for name in _SHIPPED_FILES]
    for folder in _SHIPPED_FOLDERS:
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in _TEXT_SUFFIXES and p.is_file()]
    return sorted(p for p in files if p.name != "test_docs.py" and "__pycache__" not in p.parts)


def test_code_points_to_docs_not_to_documents_outside_the_repository():
    """Comments once cited a requirement document ("the seed", in Vietnamese) and a specification
    ("SPEC section N") that are not shipped: the rule itself or a link into docs/ replaces them."""
    pointer = re.compile(
        r"(?i:the seed\b|seed's|seed_metric|seed rule|SPEC(\.md| section)|DESIGN\.md|\bsection \d)"
        r"|[\u00c0-\u024f\u1e00-\u1eff]"  # no IGNORECASE here: it would fold ASCII letters into the range
    )
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in shipped_text_files()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if pointer.search(line)
    ]
    assert len(shipped_text_files()) > 100
    assert not offenders, f"pointers to documents outside the repository: {offenders}"


def test_pointers_into_docs_from_code_and_tests_resolve():
    """Code, tests and benchmarks cite `docs/<page>.md` (and sometimes `#anchor`) for the rule they
    follow: each page and heading must exist."""
    broken = []
    for path in shipped_text_files():
        if path.is_relative_to(DOCS):
            continue
        for page, anchor in re.findall(r"docs/([\w-]+\.md)(?:#([\w-]+))?", path.read_text(errors="replace")):
            target = DOCS / page
            if not target.exists():
                broken.append(f"{path.relative_to(ROOT)}: docs/{page}")
            elif anchor:
                headings = re.findall(r"^#+ (.+)$", target.read_text(), flags=re.MULTILINE)
                if anchor not in {_anchor(h) for h in headings}:
                    broken.append(f"{path.relative_to(ROOT)}: docs/{page}#{anchor}")
    assert not broken, f"pointers into docs/ that lead nowhere: {broken}"


def readme_layout() -> dict[str, str]:
    """The README's "Layout" block: each entry under `asyncgrpo/` (a subpackage `name/` or a module
    `name.py`, indented two spaces) and what it says the entry holds."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("\n## Layout") :]
    block = section[section.index("```") + 3 :]
    block = block[: block.index("```")]
    entries, inside = {}, False
    for line in block.splitlines():
        if line.strip():
            inside = line == "asyncgrpo/" or (inside and line.startswith("  "))
        if inside and line.startswith("  ") and not line.startswith("   "):
            name, _, what = line.strip().partition(" ")
            entries[name] = what.strip()
    return entries


def test_the_readme_layout_lists_the_package_as_it_is():
    """Every subpackage and top-level module of asyncgrpo/ is in the README's layout, at its place,
    and the layout lists nothing that is not there."""
    package = ROOT / "asyncgrpo"
    actual = {f"{path.name}/" for path in package.iterdir() if (path / "__init__.py").is_file()}
    actual |= {path.name for path in package.glob("*.py") if path.name != "__init__.py"}
    listed = readme_layout()
    assert len(listed) > 10 and all(listed.values()), listed
    assert sorted(set(listed) - actual) == [], "the README's layout lists what asyncgrpo/ does not have"
    assert sorted(actual - set(listed)) == [], "asyncgrpo/ has what the README's layout does not list"
