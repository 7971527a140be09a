"""Config fields of the model the trainer loads: its from_pretrained arguments, dtype, remote code and
the MoE router's auxiliary loss.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelFields:
    """How the policy model is loaded."""

    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments of from_pretrained when the model is given by name (a dict or a JSON "
            "string); its `revision` also selects the tokenizer's revision, and its `dtype` wins over "
            "`dtype`. None: from_pretrained's defaults, with dtype and trust_remote_code from this config."
        },
    )
    dtype: str = field(
        default="float32",
        metadata={
            "help": "dtype the weights load in: 'auto', 'bfloat16', 'float16' or 'float32'. float32 because "
            "the train/inference mismatch is very sensitive to the trainer's precision; serve vLLM with the "
            "same dtype."
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "Allow model and tokenizer code from the Hub. False: running downloaded code is opt-in."
        },
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "MoE router load-balancing loss coefficient (metric aux_loss); None: the model config's "
            "router_aux_loss_coef, what the checkpoint was trained with. Setting it on a model without "
            "routed experts is an error."
        },
    )

    def _resolve_model(self) -> None:
        if isinstance(self.model_init_kwargs, str):
            self.model_init_kwargs = json.loads(self.model_init_kwargs)

    def _validate_model(self, fail) -> None:
        if self.router_aux_loss_coef is not None and self.router_aux_loss_coef < 0:
            fail(f"router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0 (None: the model config's)")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            fail(f"dtype={self.dtype!r} must be 'auto', 'bfloat16', 'float16' or 'float32'")
