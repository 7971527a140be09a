"""The library's one error family (docs/errors.md): every exception class asyncgrpo defines derives
from `AsyncGRPOError`, found by reading the source with `ast` (so a module that needs a GPU or vLLM to
import is checked too), and the branches keep the builtin bases users caught before."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

from asyncgrpo import errors

PACKAGE = Path(__file__).resolve().parents[2] / "asyncgrpo"
BASE = "AsyncGRPOError"
BUILTIN_EXCEPTIONS = {
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
}


def class_bases(sources: dict[str, str]) -> dict[str, tuple[str, list[str]]]:
    """`where:name` -> (the class's name, the names of its bases) for every class in `sources` (a
    module's path -> its text). A base is named by its last part (`errors.ServerError` -> ServerError);
    an alias (`ServerLossError = ServerLostError`) counts as a class with that one base."""
    found = {}
    for where, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(base).rsplit(".", 1)[-1] for base in node.bases]
                found[f"{where}:{node.lineno}"] = (node.name, bases)
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and len(node.targets) == 1:
                target = node.targets[0]
                if isinstance(target, ast.Name) and target.id[:1].isupper():
                    found[f"{where}:{node.lineno}"] = (target.id, [node.value.id])
    return found


def exceptions_off_the_family(sources: dict[str, str]) -> list[str]:
    """The exception classes defined in `sources` that do not derive from BASE: a class is an
    exception when a base is a builtin exception or an exception defined there (followed to the end)."""
    classes = class_bases(sources)
    bases_of: dict[str, set[str]] = {}
    for name, bases in classes.values():
        bases_of.setdefault(name, set()).update(bases)

    def ancestors(name: str, seen: frozenset = frozenset()) -> set[str]:
        found = set()
        for base in bases_of.get(name, ()):
            if base not in seen:
                found |= {base} | ancestors(base, seen | {name})
        return found

    return sorted(
        f"{where} {name}"
        for where, (name, _) in classes.items()
        if name != BASE and ancestors(name) & (BUILTIN_EXCEPTIONS | {BASE}) and BASE not in ancestors(name)
    )


def package_sources() -> dict[str, str]:
    return {
        str(path.relative_to(PACKAGE.parent)): path.read_text(encoding="utf-8")
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def test_every_exception_class_in_the_package_derives_from_the_base():
    outside = exceptions_off_the_family(package_sources())
    assert not outside, f"exception classes not deriving from asyncgrpo.errors.{BASE}: {outside}"


def test_the_scan_catches_a_class_outside_the_family():
    sources = package_sources()
    sources["asyncgrpo/planted.py"] = (
        "from asyncgrpo.generation.errors import VLLMError\n"
        "class Stray(ValueError):\n    pass\n"
        "class StrayChild(Stray):\n    pass\n"
        "class Inside(VLLMError):\n    pass\n"
        "class NotAnError:\n    pass\n"
    )
    assert [entry.split()[-1] for entry in exceptions_off_the_family(sources) if "planted" in entry] == [
        "Stray",
        "StrayChild",
    ]


@pytest.mark.parametrize(
    "branch, builtin",
    [
        (errors.ConfigurationError, ValueError),
        (errors.ServerError, RuntimeError),
        (errors.RolloutError, RuntimeError),
        (errors.WeightSyncError, RuntimeError),
        (errors.RewardError, RuntimeError),
        (errors.HarnessError, RuntimeError),
        (errors.SandboxError, RuntimeError),
        (errors.TrainingError, RuntimeError),
    ],
)
def test_each_branch_keeps_the_builtin_base_users_catch(branch, builtin):
    assert issubclass(branch, errors.AsyncGRPOError) and issubclass(branch, builtin)


def test_errors_that_had_a_builtin_base_keep_it():
    from asyncgrpo.checkpoints.failures import CheckpointSaveError
    from asyncgrpo.generation.responses import MalformedResponseError
    from asyncgrpo.harness.trace import CaptureContractError
    from asyncgrpo.run.lock import DirectoryInUseError

    assert issubclass(CheckpointSaveError, (errors.CheckpointError)) and issubclass(
        CheckpointSaveError, OSError
    )
    assert issubclass(DirectoryInUseError, errors.CheckpointError) and issubclass(
        DirectoryInUseError, RuntimeError
    )
    assert issubclass(MalformedResponseError, errors.ServerError) and issubclass(
        MalformedResponseError, ValueError
    )
    assert issubclass(CaptureContractError, errors.HarnessError) and issubclass(
        CaptureContractError, ValueError
    )


def test_one_type_for_a_lost_server_under_its_old_names():
    import asyncgrpo
    from asyncgrpo.generation.client import VLLMServerLostError, VLLMUnavailableError
    from asyncgrpo.generation.errors import ServerLostError
    from asyncgrpo.trainer.server_roster import ServerLossError

    assert asyncgrpo.ServerLostError is ServerLostError is VLLMServerLostError is ServerLossError
    # Caught as before: a lost server is one that did not answer usefully.
    assert issubclass(ServerLostError, VLLMUnavailableError) and issubclass(
        ServerLostError, errors.ServerError
    )
    one = ServerLostError("gone", "http://a:8000")
    assert (one.url, one.lost, one.weights_lost, one.run_can_go_on) == (
        "http://a:8000",
        ("http://a:8000",),
        False,
        True,
    )
    restarted = ServerLostError("restarted", "http://a:8000", weights_lost=True)
    assert restarted.weights_lost and restarted.run_can_go_on
    too_many = ServerLostError("2 of 3 lost", run_can_go_on=False, lost=("http://a:8000", "http://b:8000"))
    assert too_many.url is None and not too_many.run_can_go_on and len(too_many.lost) == 2


def test_the_family_is_exported_from_the_package():
    import asyncgrpo

    for name in ("AsyncGRPOError", "ConfigurationError", "ServerError", "ServerLostError", "CheckpointError"):
        assert name in asyncgrpo.__all__
        assert issubclass(getattr(asyncgrpo, name), errors.AsyncGRPOError)
