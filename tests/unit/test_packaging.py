"""pyproject.toml says what the package needs: every third-party module the package imports comes
from a declared dependency (core or an extra), every core dependency is used, and package data
points at files that exist. A fresh `pip install` (CI's) has nothing installed by hand."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# Modules that come with a declared dependency rather than under their own name, and why.
PROVIDED_BY = {
    "fla": "fla-core",  # the gpu extra; its import name differs and it is absent on CPU machines
    "triton": "torch",  # installed with torch's CUDA builds; head_kernels and fla-core use it (GPU only)
    "nvidia": "torch",  # nvidia.nccl: a dependency of torch's CUDA builds
}
# Modules imported only by code that runs inside another program's processes, and why they are not
# dependencies of asyncgrpo.
RUNS_ELSEWHERE = {
    "vllm": "generation/vllm_worker_extension.py runs inside a vLLM server's workers, where vLLM is; "
    "the trainer talks to servers over HTTP and never imports it",
}
# Core dependencies the package never imports, and why they are declared anyway.
NOT_IMPORTED = {"accelerate": "transformers' Trainer needs it and does not install it"}


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~ \[;]", requirement.strip())[0]).lower()


def imported_modules() -> dict[str, str]:
    """Top-level third-party modules the package imports, with one place that imports each."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "asyncgrpo").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "asyncgrpo" and top not in sys.stdlib_module_names:
                    found.setdefault(top, f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_imported_module_is_declared_and_every_core_dependency_is_used():
    core = {_name(requirement) for requirement in PYPROJECT["project"]["dependencies"]}
    extras = {
        _name(requirement)
        for requirements in PYPROJECT["project"]["optional-dependencies"].values()
        for requirement in requirements
    }
    distributions = packages_distributions()
    imported = imported_modules()
    assert {"torch", "transformers", "msgspec", "yaml"} <= set(imported)
    undeclared, used = [], set()
    for module, where in sorted(imported.items()):
        names = {_name(d) for d in distributions.get(module, [])} or {PROVIDED_BY.get(module, module)}
        used |= names
        if not names & (core | extras) and module not in RUNS_ELSEWHERE:
            undeclared.append(f"{module} ({where})")
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    unused = sorted(core - used - set(NOT_IMPORTED))
    assert not unused, f"core dependencies nothing in asyncgrpo/ imports: {unused}"


def test_package_data_points_at_files():
    package_data = PYPROJECT.get("tool", {}).get("setuptools", {}).get("package-data", {})
    for package, patterns in package_data.items():
        folder = ROOT / package.replace(".", "/")
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"package-data {package}: {pattern} matches no file"
