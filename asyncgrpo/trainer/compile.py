"""`torch_compile=True`: regional compilation of the decoder layers (with `torch_compile_mode` and
`torch_compile_backend`).

Compiling each decoder layer (once: the layers share code, and shapes are dynamic because rows
vary in length) fuses the norms, rotary embedding and activation that eager mode runs one kernel at
a time, which makes fwd+bwd markedly faster on a GPU (docs/gpu-performance.md). The whole model is
not compiled: the trainer calls the decoder and the output head separately (the head runs only at
trained positions).
"""

from __future__ import annotations

import torch

from asyncgrpo.errors import ConfigurationError


def take_compile_options(args) -> dict[str, str | None] | None:
    """The `torch.compile` options of each decoder layer (`torch_compile_mode`, `torch_compile_backend`),
    or None when `torch_compile` is off; taken off the trainer's own `args`: the base Trainer would
    compile the whole model, whose forward this trainer does not call."""
    if not args.torch_compile:
        return None
    options = {"mode": args.torch_compile_mode, "backend": args.torch_compile_backend}
    args.torch_compile, args.torch_compile_backend, args.torch_compile_mode = False, None, None
    return options


def compile_decoder_layers(
    model: torch.nn.Module, mode: str | None = None, backend: str | None = None
) -> int:
    """Compile every decoder layer in place with `mode` and `backend` (None: torch's defaults); returns
    how many were compiled."""
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ConfigurationError(
            f"{type(decoder).__name__} has no `layers` to compile; set torch_compile=False"
        )
    options = {"mode": mode, "backend": backend}
    for layer in layers:
        layer.compile(dynamic=True, **{name: value for name, value in options.items() if value is not None})
    return len(layers)
