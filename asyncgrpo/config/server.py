"""Config fields of the vLLM servers: where they listen, how the set of them may change during a run,
and how long a wait for them may take."""

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
    vllm_server_urls_file: str | None = field(
        default=None,
        metadata={
            "help": "A file of vLLM server URLs, one per line ('#' starts a comment), re-read every few "
            "seconds during training: a server added to it joins the run once it answers (checked against "
            "the first server's flags, model and dtype, given the current weights, then given work), one "
            "taken out of it leaves the run. SLURM jobs and Kubernetes pods write it as servers come and go "
            "(docs/scaling.md). None: the servers are vllm_server_base_url's for the whole run (which may "
            "then be empty: the run starts with the first server the file lists)."
        },
    )
    max_lost_server_fraction: float = field(
        default=1.0,
        metadata={
            "help": "The fraction of the run's servers that may be lost at once (not answering, or back but "
            "not yet given the weights) before the run stops with an error naming them. A lost server "
            "costs its share of generation, not the run: its requests go to the others, and it rejoins "
            "when it answers again. 1.0: any number; only having no server at all for vllm_server_timeout "
            "stops the run. Lower it when losing many at once means something is wrong that a long run "
            "should not hide (a bad node pool, a network split): 0.25 stops a run of 16 servers once 5 are "
            "lost, instead of training on at a fraction of its speed."
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
        if not self.vllm_server_urls and not self.vllm_server_urls_file:
            fail(
                "vllm_server_base_url is empty: give the URL of a running `vllm serve`, or a "
                "vllm_server_urls_file that will list one"
            )
        if not 0.0 < self.max_lost_server_fraction <= 1.0:
            fail(
                f"max_lost_server_fraction={self.max_lost_server_fraction} must be in (0, 1]: the fraction "
                "of the servers that may be lost at once (1.0: any number)"
            )
        for url in self.vllm_server_urls:
            if not url.startswith(("http://", "https://")):
                fail(f"vllm_server_base_url {url!r} must start with http:// or https://")
        for name in ("vllm_server_timeout", "request_timeout", "weight_sync_timeout"):
            if getattr(self, name) <= 0:
                fail(f"{name}={getattr(self, name)} must be > 0")
