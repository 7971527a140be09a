"""A stand-in for an experiment tracker's module, for tests of `report_to` and `log_completions`."""

from __future__ import annotations

import importlib.machinery
import types


class RecordingTracker(types.ModuleType):
    """A stand-in for a tracker module (trackio's API as transformers' callback and TRL use it):
    records what is logged, sends nothing anywhere."""

    class Table:
        def __init__(self, dataframe=None):
            self.dataframe = dataframe

    class Config(dict):
        def update(self, values, allow_val_change=False):
            super().update(values)

    def __init__(self, name: str):
        super().__init__(name)
        self.__spec__ = importlib.machinery.ModuleSpec(name, None)
        self.__version__ = "0.0"
        self.run = object()  # wandb's "a run is open"
        self.config = self.Config()
        self.context_vars = types.SimpleNamespace(current_space_id=types.SimpleNamespace(get=lambda: None))
        self.logged: list[dict] = []

    def init(self, **kwargs):
        pass

    def log(self, values, step=None):
        self.logged.append(dict(values))

    def finish(self):
        pass
