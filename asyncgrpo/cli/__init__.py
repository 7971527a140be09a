"""The command line: `asyncgrpo train | serve | report | export | demo | tiny-model`, and reading run
configs."""

from asyncgrpo.cli.main import main

__all__ = ["main"]
