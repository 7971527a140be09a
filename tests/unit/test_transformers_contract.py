"""The private parts of transformers' `Trainer` that asyncgrpo's trainer overrides or calls.

transformers may change a private method in any release; pyproject.toml pins the releases the
tests ran with, and this test names the method when an installed release no longer matches (or when
the trainer starts using a private method that is not listed here)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

# transformers' Trainer imports datasets, which a GPU host may lack (tests/unit/test_gpu_collection.py).
pytest.importorskip(
    "datasets", reason="datasets is not installed (a GPU host may lack the non-torch dependencies)"
)

from transformers import Trainer  # noqa: E402

TRAINER_PACKAGE = Path(__file__).resolve().parents[2] / "asyncgrpo" / "trainer"

# name -> its parameters (after self) as the trainer relies on them
PRIVATE_METHODS = {
    "_inner_training_loop": ["batch_size", "args", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"],
    "_prepare_for_training": ["max_steps", "train_dataloader", "resume_from_checkpoint"],
    "_get_output_dir": ["trial"],
    "_save_checkpoint": ["model", "trial"],
    "_save_optimizer_and_scheduler": ["output_dir"],
    "_save_scaler": ["output_dir"],
    "_save_rng_state": ["output_dir"],
    "_load_callback_state": [],
    "_push_from_checkpoint": ["checkpoint_folder"],
    "_determine_best_metric": ["metrics", "trial"],
    "_load_best_model": [],
    "_load_from_checkpoint": ["resume_from_checkpoint", "model"],
}


def private_base_methods_used() -> set[str]:
    """Private methods of transformers' Trainer named (called or defined) in asyncgrpo/trainer/."""
    names = set()
    for path in TRAINER_PACKAGE.glob("*.py"):
        source = path.read_text(encoding="utf-8")
        names |= set(re.findall(r"\.(_[a-z]\w*)\(", source)) | set(re.findall(r"def (_[a-z]\w*)\(", source))
    return {name for name in names if callable(getattr(Trainer, name, None))}


@pytest.mark.parametrize("name", sorted(PRIVATE_METHODS))
def test_private_method_has_the_signature_the_trainer_relies_on(name):
    method = getattr(Trainer, name, None)
    assert method is not None, (
        f"transformers.Trainer.{name} no longer exists: asyncgrpo's trainer uses it (pin transformers to a "
        f"release that has it, or adapt asyncgrpo/trainer/)"
    )
    parameters = [p for p in inspect.signature(method).parameters if p != "self"]
    assert parameters == PRIVATE_METHODS[name], (
        f"transformers.Trainer.{name} changed its parameters from {PRIVATE_METHODS[name]} to {parameters}: "
        f"asyncgrpo's trainer overrides or calls it (pin transformers to a release with the old signature, "
        f"or adapt asyncgrpo/trainer/)"
    )


def test_every_private_method_the_trainer_uses_is_listed():
    unlisted = private_base_methods_used() - set(PRIVATE_METHODS)
    assert not unlisted, (
        f"asyncgrpo/trainer/ uses private Trainer methods not checked here: {sorted(unlisted)}"
    )


def test_the_version_check_asks_for_the_release_the_package_pins():
    """The trainer's own check says the lowest release pyproject.toml allows, not an older one."""
    import tomllib

    from packaging.version import Version

    from asyncgrpo.trainer.checks import MIN_TRANSFORMERS

    pyproject = tomllib.loads((TRAINER_PACKAGE.parents[1] / "pyproject.toml").read_text())
    (pin,) = [spec for spec in pyproject["project"]["dependencies"] if re.match(r"transformers\b", spec)]
    (lowest,) = re.findall(r">=\s*([\d.]+)", pin)
    assert Version(MIN_TRANSFORMERS) == Version(lowest), (MIN_TRANSFORMERS, pin)
