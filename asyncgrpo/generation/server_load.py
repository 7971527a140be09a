"""The vLLM server's load, read from its Prometheus `/metrics` text.

The rollout worker sizes its concurrency cap from these numbers (docs/architecture.md, "Three limits
on generation") and logs them as
`rollout/vllm_*`. One server may run several engines (data parallel): KV usage is the maximum over
engines (the fullest one preempts first), counts are sums.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from asyncgrpo.generation.errors import MalformedResponseError

_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(\{[^}]*\})?\s+(\S+)", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True)
class ServerLoad:
    kv_cache_usage: float  # fraction 0..1, max over engines
    running: int
    waiting: int
    preemptions: int  # cumulative since the server started
    kv_cache_tokens: int  # KV capacity in tokens, summed over engines; 0 when unknown

    @staticmethod
    def combine(loads: list["ServerLoad"]) -> "ServerLoad":
        """The load of several servers seen as one pool."""
        return ServerLoad(
            kv_cache_usage=max((load.kv_cache_usage for load in loads), default=0.0),
            running=sum(load.running for load in loads),
            waiting=sum(load.waiting for load in loads),
            preemptions=sum(load.preemptions for load in loads),
            kv_cache_tokens=sum(load.kv_cache_tokens for load in loads),
        )


def parse_server_load(text: str) -> ServerLoad:
    """Parse `/metrics`. Raises MalformedResponseError (a ValueError) when the text holds no vLLM
    engine metrics."""
    usage: list[float] = []
    running = waiting = preemptions = kv_tokens = 0
    found = False
    for name, labels, value in _SAMPLE.findall(text):
        if name == "vllm:kv_cache_usage_perc":
            usage.append(float(value))
            found = True
        elif name == "vllm:num_requests_running":
            running += int(float(value))
            found = True
        elif name == "vllm:num_requests_waiting":
            waiting += int(float(value))
        elif name == "vllm:num_preemptions_total":
            preemptions += int(float(value))
        elif name == "vllm:cache_config_info":
            kv_tokens += _kv_capacity_tokens(dict(_LABEL.findall(labels)))
    if not found:
        raise MalformedResponseError("no vllm:* engine metrics in /metrics")
    return ServerLoad(max(usage, default=0.0), running, waiting, preemptions, kv_tokens)


def _kv_capacity_tokens(labels: dict[str, str]) -> int:
    size = labels.get("kv_cache_size_tokens", "None")
    if size.isdigit():
        return int(size)
    blocks, block_size = labels.get("num_gpu_blocks", "None"), labels.get("block_size", "None")
    if blocks.isdigit() and block_size.isdigit():
        return int(blocks) * int(block_size)
    return 0
