"""Changing what a vLLM server does (dev mode, VLLM_SERVER_DEV_MODE=1): pause and resume, weight
reloads and labels, LoRA adapters, and vLLM's native weight-transfer protocol (NCCL).

`ServerControl` is a base class of `VLLMClient` (generation/client.py), whose HTTP calls it uses.
The calls of a weight sync skip a server they cannot reach and return those servers, so that one
server lost cannot stop a sync of the others (the trainer counts it lost: trainer/server_roster.py);
a server that answers with an error still raises. The native protocol's calls are never retried:
each joins a collective or a step that must happen exactly once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asyncgrpo.generation.errors import VLLMRequestError, VLLMUnavailableError
from asyncgrpo.generation.server_info import parse_server_info
from asyncgrpo.generation.vllm_worker_extension import RELOAD_METHOD, WORKER_EXTENSION

logger = logging.getLogger(__name__)

# A server whose connections fail this long is lost: long enough to ride out a dropped connection (a
# kept-alive one the server closed), short against the restart of a server that went away. A weight
# sync's call then skips it; a generation request with no other server to go to then waits for one.
UNREACHABLE_AFTER_S = 5.0


async def _all_finished(calls) -> list[Any]:
    """Await the calls together; every one runs to its end even when another fails (a failed pause
    must not leave the other servers un-resumed), and the first error is raised after all finished."""
    answers = await asyncio.gather(*calls, return_exceptions=True)
    for answer in answers:
        if isinstance(answer, BaseException):
            raise answer
    return list(answers)


class ServerControl:
    """The control calls of `VLLMClient`; every one goes to all its servers, or to `urls`."""

    base_urls: list[str]
    _reload_methods: dict[str, str]

    async def _on_reachable(
        self, method: str, path: str, payload: Any = None, urls: list[str] | None = None, **kwargs
    ) -> list[str]:
        """`_on_all` for the calls of a weight sync (`_reachable`): returns the servers it could not
        reach."""
        kwargs.setdefault("unreachable_after", UNREACHABLE_AFTER_S)
        targets = self.base_urls if urls is None else urls
        return await self._reachable(
            {url: self._json(method, url, path, payload, **kwargs) for url in targets}
        )

    @staticmethod
    async def _reachable(calls: dict[str, Any]) -> list[str]:
        """Await one call per server (url -> coroutine), each to its end. A server that could not be
        reached (refusing connections for UNREACHABLE_AFTER_S, no answer in time, a dead
        engine) is skipped, not an error: returns those servers. One that answered with an error
        raises, after all have finished."""
        answers = await asyncio.gather(*calls.values(), return_exceptions=True)
        unreachable = []
        for url, answer in zip(calls, answers):
            if isinstance(answer, VLLMUnavailableError):
                logger.warning("vLLM server %s was skipped: %s", url, answer)
                unreachable.append(url)
        for answer in answers:
            if isinstance(answer, BaseException) and not isinstance(answer, VLLMUnavailableError):
                raise answer
        return unreachable

    async def pause(
        self,
        mode: str = "keep",
        clear_cache: bool = False,
        timeout: float | None = None,
        urls: list[str] | None = None,
    ) -> list[str]:
        """Stop scheduling. `keep` freezes running requests (they continue on resume), `wait`
        lets them finish first, `abort` ends them. `clear_cache=True` also empties the KV and
        prefix caches, which under `keep` preempts every frozen request: on resume each one
        recomputes its whole KV. The trainer does not need that: requests carry their policy
        version as `cache_salt` (see `policy_cache_salt`), so no request reuses a prefix computed
        by older weights than its own version's."""
        clear = "true" if clear_cache else "false"
        params = {"mode": mode, "clear_cache": clear}
        return await self._on_reachable("POST", "/pause", params=params, timeout=timeout, urls=urls)

    async def resume(self, timeout: float | None = None, urls: list[str] | None = None) -> list[str]:
        return await self._on_reachable("POST", "/resume", timeout=timeout, urls=urls)

    async def is_paused(self) -> bool:
        return all(answer["is_paused"] for answer in await self._on_all("GET", "/is_paused"))

    async def reset_prefix_cache(self) -> None:
        await self._on_all("POST", "/reset_prefix_cache")

    async def set_weight_label(self, label: str, urls: list[str] | None = None) -> list[str]:
        """Label the weights every server runs (what `weight_labels` reports) without loading any."""
        return await self._on_reachable("POST", "/update_weight_version", {"new_version": label}, urls=urls)

    async def reload_weights(
        self,
        weights_dir: str,
        version: str | None = None,
        timeout: float | None = None,
        urls: list[str] | None = None,
    ) -> list[str]:
        """Load new weights from a directory of safetensors (HF names) on every server. Prefix-cache
        entries of the old weights stay, under their own `cache_salt`; callers that send no salt
        must `reset_prefix_cache` (it succeeds only once no request holds blocks). A server started
        with asyncgrpo's worker extension reloads through it (`_reload_method`)."""

        lost = {"unreachable_after": UNREACHABLE_AFTER_S, "timeout": timeout}

        async def reload(url: str) -> None:
            method = await self._reload_method(url)
            payload = {"method": method, "kwargs": {"weights_path": str(weights_dir)}}
            calls = [self._json("POST", url, "/collective_rpc", payload, retry_server_errors=False, **lost)]
            if version is not None:  # only a label: set it alongside, not after, while the server waits
                calls.append(
                    self._json("POST", url, "/update_weight_version", {"new_version": version}, **lost)
                )
            await _all_finished(calls)

        return await self._reachable({url: reload(url) for url in (self.base_urls if urls is None else urls)})

    async def _reload_method(self, url: str) -> str:
        """vLLM's `reload_weights`, or the worker extension's reload on a server started with it (it
        repacks fused-MoE weights that vLLM's own reload leaves unpacked on CPU). Read once per server
        from `/server_info`: the extension is a start-up flag."""
        if url not in self._reload_methods:
            try:
                answer = await self._json(
                    "GET", url, "/server_info", params={"config_format": "json"},
                    unreachable_after=UNREACHABLE_AFTER_S,
                )  # fmt: skip
            except VLLMRequestError:
                answer = None
            info = parse_server_info(answer if isinstance(answer, dict) else None)
            extended = info is not None and info.worker_extension == WORKER_EXTENSION
            self._reload_methods[url] = RELOAD_METHOD if extended else "reload_weights"
        return self._reload_methods[url]

    # -- native weight transfer (`--weight-transfer-config`): never retried, each call joins a
    # collective or a protocol step that must happen exactly once --------------------------------

    async def init_weight_transfer_engine(self, init_infos: dict[str, dict[str, Any]]) -> None:
        """Join the workers of each server (url -> its `init_info`) to the transfer group. Blocks
        until the whole group has joined, the trainer included."""
        await _all_finished(
            self._request("POST", url, "/init_weight_transfer_engine", {"init_info": info}, retry=False)
            for url, info in init_infos.items()
        )

    async def start_weight_update(self, urls: list[str], timeout: float | None = None) -> None:
        await self._on_all("POST", "/start_weight_update", retry=False, timeout=timeout, urls=urls)

    async def update_weights(
        self, update_info: dict[str, Any], urls: list[str], timeout: float | None = None
    ) -> None:
        """Receive the broadcast described by `update_info` (names, dtype_names, shapes); returns
        when the servers have loaded every tensor, so the trainer must broadcast meanwhile."""
        payload = {"update_info": update_info}
        await self._on_all("POST", "/update_weights", payload, retry=False, timeout=timeout, urls=urls)

    async def finish_weight_update(self, version: str, urls: list[str], timeout: float | None = None) -> None:
        payload = {"weight_version": version}
        await self._on_all("POST", "/finish_weight_update", payload, retry=False, timeout=timeout, urls=urls)

    async def shutdown_weight_transfer_engine(self, urls: list[str], timeout: float | None = None) -> None:
        await self._on_all(
            "POST", "/shutdown_weight_transfer_engine", retry=False, timeout=timeout, urls=urls
        )

    async def load_lora_adapter(
        self, name: str, path: str, load_inplace: bool = False, urls: list[str] | None = None
    ) -> list[str]:
        """Load an adapter from `path` (readable by the servers) as model `name`; `load_inplace`
        replaces one already loaded under that name (and loads it where it is not)."""
        payload = {"lora_name": name, "lora_path": str(path), "load_inplace": load_inplace}
        return await self._on_reachable("POST", "/v1/load_lora_adapter", payload, urls=urls)

    async def unload_lora_adapter(self, name: str, urls: list[str] | None = None) -> list[str]:
        return await self._on_reachable("POST", "/v1/unload_lora_adapter", {"lora_name": name}, urls=urls)
