"""Config fields of the vLLM servers: where they listen and how long a wait for them may take."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerFields:
    """The vLLM servers' URLs and timeouts."""

    vllm_server_base_url: str | list[str] = field(
        default="http://localhost:8000",
        metadata={
            "help": "One URL, several separated by commas, or a list: requests go to the least busy. "
            "http://localhost:8000: where `vllm serve` listens by default."
        },
    )
    vllm_server_timeout: float = field(
        default=1800.0,
        metadata={
            "help": "Seconds bounding every wait for the server: start-up (TRL's meaning), and each request "
            "and each weight sync unless request_timeout / weight_sync_timeout say otherwise. 1800: a large "
            "model's server can take many minutes to start; a timed-out generation request is retried."
        },
    )
    request_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds one generation request may take before it is retried (a few times, then the run "
            "fails). None: vllm_server_timeout (TRL's default is 600)."
        },
    )
    weight_sync_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds each server call of a weight sync may take (pause, reload or NCCL broadcast, "
            "resume) before the sync raises instead of hanging. None: vllm_server_timeout (TRL's default is "
            "1800)."
        },
    )

    def _resolve_server(self) -> None:
        if self.request_timeout is None:
            self.request_timeout = self.vllm_server_timeout
        if self.weight_sync_timeout is None:
            self.weight_sync_timeout = self.vllm_server_timeout

    @property
    def vllm_server_urls(self) -> list[str]:
        """The servers' URLs, parsed from `vllm_server_base_url`, which keeps what the user set (TRL's
        scripts read it back as the string they gave)."""
        given = self.vllm_server_base_url
        parts = given.split(",") if isinstance(given, str) else given
        return [url.strip() for url in parts if url.strip()]

    def _validate_server(self, fail) -> None:
        if not self.vllm_server_urls:
            fail("vllm_server_base_url is empty: give the URL of a running `vllm serve`")
        for url in self.vllm_server_urls:
            if not url.startswith(("http://", "https://")):
                fail(f"vllm_server_base_url {url!r} must start with http:// or https://")
        for name in ("vllm_server_timeout", "request_timeout", "weight_sync_timeout"):
            if getattr(self, name) <= 0:
                fail(f"{name}={getattr(self, name)} must be > 0")
