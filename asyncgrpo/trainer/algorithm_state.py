"""What the loss menu carries from step to step, saved in a checkpoint so a resumed run continues it:
the adaptive entropy coefficient (`use_adaptive_entropy`) and, with `sync_ref_model`, the reference the
TR-DPO updates have moved away from the initial model. Without them a resume would restart the
coefficient and snap the reference back to the initial weights. JSON and safetensors: loading a
checkpoint never unpickles anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from asyncgrpo.run.durable_files import write_atomically

ALGORITHM_STATE_FILE = "algorithm_state.json"
REFERENCE_MODEL_FILE = "reference_model.safetensors"


@dataclass
class AlgorithmState:
    entropy_coefficient: dict | None = None  # losses.EntropyCoefficient.state()
    reference: dict[str, torch.Tensor] | None = None  # the synced reference's whole state, on CPU

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        if self.entropy_coefficient is not None:
            text = json.dumps({"entropy_coefficient": self.entropy_coefficient}, indent=2)
            write_atomically(directory / ALGORITHM_STATE_FILE, text)
        if self.reference is not None:
            # Tied weights share storage, which safetensors refuses: each tensor is written on its own.
            save_file({name: t.detach().contiguous().clone() for name, t in self.reference.items()},
                      str(directory / REFERENCE_MODEL_FILE))  # fmt: skip

    @classmethod
    def load(cls, directory: str | Path) -> AlgorithmState:
        directory = Path(directory)
        state = cls()
        path = directory / ALGORITHM_STATE_FILE
        if path.exists():
            state.entropy_coefficient = json.loads(path.read_text())["entropy_coefficient"]
        if (directory / REFERENCE_MODEL_FILE).exists():
            state.reference = load_file(str(directory / REFERENCE_MODEL_FILE))
        return state
