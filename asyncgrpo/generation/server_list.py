"""The run's first servers, worked out in one place: the configured URLs, the server list file, or
those the trainer handed to a rollout worker (docs/reliability.md, "Elastic servers"). Light to
import: the rollout worker reads it without torch."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


def read_server_list(path: str | Path) -> list[str]:
    """The URLs a server list file names, one per line, in order ('#' starts a comment). A file
    not there yet names none: the servers may not have written it."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    urls = []
    for line in text.splitlines():
        url = line.split("#", 1)[0].strip().rstrip("/")
        if url and url not in urls:
            urls.append(url)
    return urls


def starting_servers(
    configured: Sequence[str], urls_file: str | None = None, handed: Sequence[str] = ()
) -> list[str]:
    """The servers a run, an evaluation or a rollout worker starts with, worked out here only: those
    the trainer handed over (a rollout worker's), else the configured ones (`vllm_server_base_url`),
    else those `vllm_server_urls_file` lists now (none while it is not written yet)."""
    if handed:
        return list(handed)
    if configured:
        return list(configured)
    return read_server_list(urls_file) if urls_file else []
