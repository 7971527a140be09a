"""The repository explains itself: every setting and every logged metric is documented in docs/,
links inside docs/ resolve, and code and tests point to docs/ rather than to documents that are not
in the repository."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from asyncgrpo.config import AsyncGRPOConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def python_sources(*folders: str) -> list[Path]:
    return sorted(path for folder in folders for path in (ROOT / folder).rglob("*.py"))


def test_every_config_field_has_help_text_and_a_documented_entry():
    configuration = (DOCS / "configuration.md").read_text()
    own = AsyncGRPOConfig.__annotations__
    fields = [field for field in dataclasses.fields(AsyncGRPOConfig) if field.name in own]
    assert len(fields) == len(own)
    missing_help = [field.name for field in fields if not field.metadata.get("help")]
    undocumented = [field.name for field in fields if f"`{field.name}`" not in configuration]
    assert not missing_help, f"fields without help text: {missing_help}"
    assert not undocumented, f"fields missing from docs/configuration.md: {undocumented}"


# A metric name as the code records it: the first argument of record/record_rate/add, or a key of
# the loss's metrics dicts. f-string placeholders ({name}) are kept as they are written in the docs.
_RECORDED = re.compile(r"""(?:record|record_rate|add)\(\s*f?"([a-z_{}]+(?:/[a-z_{}]+)*)\"""")
_LOSS_KEY = re.compile(r"""["']((?:sampling|clip_ratio)/[a-z_/]+)["']""")


def recorded_metric_names() -> set[str]:
    names = set()
    for path in python_sources("asyncgrpo"):
        text = path.read_text()
        names.update(_RECORDED.findall(text))
        names.update(_LOSS_KEY.findall(text))
    return {name.replace("{name}", "{reward_func_name}") for name in names}


def test_every_recorded_metric_is_in_the_metric_reference():
    reference = (DOCS / "metrics.md").read_text()
    names = recorded_metric_names()
    assert {"loss", "reward", "rollout/queue_size", "sampling/sampler_mass", "perf/fwd_bwd_mfu"} <= names
    undocumented = sorted(name for name in names if f"`{name}`" not in reference)
    assert not undocumented, f"metrics missing from docs/metrics.md: {undocumented}"


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


def test_code_points_to_docs_not_to_documents_outside_the_repository():
    """Comments once cited a requirement document and a specification that are not shipped."""
    pointer = re.compile(
        r"the seed|seed's|seed_metric|SPEC section|\(seed rule\)|[\u00c0-\u024f\u1e00-\u1eff]"
    )
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in python_sources("asyncgrpo", "tests")
        if path.name != "test_docs.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pointer.search(line)
    ]
    assert not offenders, f"pointers to documents outside the repository: {offenders}"
