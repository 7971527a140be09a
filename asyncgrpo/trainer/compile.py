"""`torch_compile=True`: regional compilation of the decoder layers.

Compiling each decoder layer (once: the layers share code, and shapes are dynamic because rows
vary in length) fuses the norms, rotary embedding and activation that eager mode runs one kernel at
a time, which makes fwd+bwd markedly faster on a GPU (docs/gpu-performance.md). The whole model is
not compiled: the trainer calls the decoder and the output head separately (the head runs only at
trained positions).
"""

from __future__ import annotations

import torch


def compile_decoder_layers(model: torch.nn.Module) -> int:
    """Compile every decoder layer in place; returns how many were compiled."""
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(decoder).__name__} has no `layers` to compile; set torch_compile=False")
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)
