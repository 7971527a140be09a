"""What each of several rollout worker processes owns: its prompts, its servers, its group ids.

With `num_rollout_workers` = K, worker k generates the prompts whose stream index is k modulo K, so the
workers together cover the stream exactly once and the trainer's prompt ledger (which counts stream
indices) needs no change: a resumed run hands every worker the same resume position and skip set,
and each keeps its own share of it. Servers are dealt out the same way; with fewer servers than
workers, workers share servers. Group ids are k, k + K, k + 2K, ... so that no two workers ever use
the same one. docs/scaling.md says when to raise K.
"""

from __future__ import annotations

from asyncgrpo.errors import ConfigurationError


def owns_stream_index(stream_index: int, worker_index: int, num_workers: int) -> bool:
    return stream_index % num_workers == worker_index


def worker_servers(urls: list[str], worker_index: int, num_workers: int) -> list[str]:
    """The servers worker `worker_index` sends its requests to."""
    if not urls:
        raise ConfigurationError("no vLLM server URL to share among the rollout workers")
    if len(urls) >= num_workers:
        return urls[worker_index::num_workers]
    return [urls[worker_index % len(urls)]]


def share_of_range(start: int, stop: int, worker_index: int, num_workers: int) -> int:
    """How many stream indices in [start, stop) worker `worker_index` owns."""

    def owned_below(limit: int) -> int:  # indices i in [0, limit) with i % K == k
        return max(0, (limit - worker_index + num_workers - 1) // num_workers)

    return owned_below(stop) - owned_below(start)
