"""Starting `vllm serve` with the flags the trainer needs, for users (`asyncgrpo serve`) and tests.

The trainer relies on: dev-mode endpoints (pause/resume, reload, weight transfer:
`VLLM_SERVER_DEV_MODE=1`), log-probs of the distribution actually sampled
(`--logprobs-mode processed_logprobs`), and sampling defaults that come from the request, not the
model's generation_config (`--generation-config vllm`). On CPU, vLLM needs `--enforce-eager` to
start in seconds and a bounded KV space; on GPU the native NCCL weight transfer is enabled. A server
with an API key requires it on every route but liveness (server_auth.py); one bound beyond loopback
without a key is refused unless `insecure_no_api_key`. A distillation teacher is never sent weights, so
its server has neither the dev-mode endpoints nor the weight transfer (`receives_weights=False`).
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from asyncgrpo.errors import ConfigurationError, ServerError
from asyncgrpo.generation.model_flags import model_flags
from asyncgrpo.generation.server_auth import (
    API_KEY_ENV,
    auth_headers,
    exposure_error,
    guard_additions,
    unguarded_frontend_error,
)
from asyncgrpo.run.redaction import redact_argv, redact_env

# "0" keeps a CPU server's model in its engine core process (build_command).
VLLM_MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"

# The values vLLM accepts for --max-lora-rank.
SERVABLE_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def serving_lora_rank(rank: int) -> int | None:
    """The smallest `--max-lora-rank` that serves an adapter of `rank`; None above vLLM's largest."""
    return next((value for value in SERVABLE_LORA_RANKS if value >= rank), None)


def lora_flags_for_run(lora_rank: int | None, max_staleness: int) -> dict[str, int | None]:
    """`--max-lora-rank` and `--max-loras` for a run training adapters of `lora_rank` with
    `max_staleness`: the trainer keeps max_staleness + 1 versions loaded and loads one more per sync."""
    if lora_rank is not None and serving_lora_rank(lora_rank) is None:
        raise ConfigurationError(
            f"--lora-rank {lora_rank} is above vLLM's largest --max-lora-rank {SERVABLE_LORA_RANKS[-1]}"
        )
    return {
        "max_lora_rank": None if lora_rank is None else serving_lora_rank(lora_rank),
        "max_loras": max_staleness + 2,
    }


@dataclass
class ServerOptions:
    model: str
    port: int = 8000
    host: str = "127.0.0.1"
    max_model_len: int | None = None
    dtype: str | None = None
    enable_lora: bool = False
    max_lora_rank: int | None = None
    max_loras: int | None = None
    # None: decide from torch.cuda.is_available() in this process.
    cpu: bool | None = None
    # CPU only: GiB of RAM for the KV cache (VLLM_CPU_KVCACHE_SPACE); vLLM's default takes far more.
    cpu_kv_cache_gib: int = 1
    # MoE routing replay: each response carries the experts its tokens were routed to.
    return_routed_experts: bool = False
    extra_args: list[str] = field(default_factory=list)
    # Every route but liveness requires it; it reaches the server in its environment, never its argv.
    api_key: str | None = field(default=None, repr=False)
    # A server bound beyond loopback without a key is refused unless this is set, by name.
    insecure_no_api_key: bool = False
    # False for a distillation teacher, never sent weights: no dev-mode routes, no weight transfer.
    receives_weights: bool = True

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def _on_cpu(options: ServerOptions) -> bool:
    if options.cpu is not None:
        return options.cpu
    import torch

    return not torch.cuda.is_available()


def vllm_entry_point() -> list[str]:
    """How to run vLLM's CLI: from this interpreter when it has vllm, else the `vllm` on PATH."""
    if importlib.util.find_spec("vllm") is not None:
        return [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    executable = shutil.which("vllm")
    if executable is None:
        raise ServerError(
            "vLLM is not installed in this environment and no `vllm` is on PATH: install it "
            "(`pip install vllm`, or `make venv` for the CPU build) or start the server yourself"
        )
    return [executable]


def build_command(options: ServerOptions) -> tuple[list[str], dict[str, str]]:
    """The argv and the environment additions of the server process; a ValueError when the server
    must not start as asked (open to the network, a key on the command line)."""
    refusal = exposure_error(options.host, options.port, options.api_key, options.insecure_no_api_key)
    if any(argument.split("=")[0] == "--api-key" for argument in options.extra_args):
        refusal = "--api-key among vLLM's arguments: give the key as ServerOptions.api_key (--api-key-file)"
    if options.api_key and refusal is None:
        refusal = unguarded_frontend_error(options.extra_args, dict(os.environ))
    if refusal:
        raise ConfigurationError(refusal)
    on_cpu = _on_cpu(options)
    argv = [
        *vllm_entry_point(),
        "serve",
        options.model,
        "--host",
        options.host,
        "--port",
        str(options.port),
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
        "--enable-scale-out",
    ]
    if options.max_model_len is not None:
        argv += ["--max-model-len", str(options.max_model_len)]
    if options.dtype is not None:
        argv += ["--dtype", options.dtype]
    family_flags, reasons = model_flags(options.model, on_cpu, options.dtype)
    for reason in reasons:
        print(f"asyncgrpo serve: {reason}", file=sys.stderr)
    argv += family_flags
    if on_cpu:
        # Chunked prefill splits a prompt over engine steps and discards the sample of each partial
        # step; vLLM-CPU 0.32 then rewinds the request's seeded CPU generator, which CPU generators
        # do not support ("CPU Generator does not use offset"), and the engine dies. Every request of
        # ours is seeded, so on CPU prompts are prefilled whole.
        argv += ["--enforce-eager", "--no-enable-chunked-prefill"]
    elif options.receives_weights:
        argv += ["--weight-transfer-config", '{"backend": "nccl"}']
    env = {"VLLM_SERVER_DEV_MODE": "1"} if options.receives_weights else {}
    if Path(options.model).is_dir() and "HF_HUB_OFFLINE" not in os.environ:
        # A local model needs nothing from the Hub, and vLLM's lookups there would only wait for a
        # network timeout on a machine without one. A Hub id must be free to download; a user's own
        # HF_HUB_OFFLINE reaches the server unchanged (it inherits this environment).
        env["HF_HUB_OFFLINE"] = "1"
    if on_cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(options.cpu_kv_cache_gib)
        if VLLM_MULTIPROCESSING_ENV not in os.environ:
            # On CPU vLLM runs its model in a worker process beside the engine core unless told
            # otherwise; that process imports vLLM once more at start, and its queue reader spins a
            # core for a second after every engine step. With this variable the single-process
            # executor runs the model inside the engine core instead (docs/testing.md, "What a
            # vLLM CPU server costs"). A user's own setting wins; tensor parallelism still spawns
            # its workers.
            env[VLLM_MULTIPROCESSING_ENV] = "0"
    if options.enable_lora:
        argv += ["--enable-lora"]
        if options.max_lora_rank is not None:
            argv += ["--max-lora-rank", str(options.max_lora_rank)]
        if options.max_loras is not None:
            argv += ["--max-loras", str(options.max_loras)]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if options.return_routed_experts:
        if on_cpu:
            raise ConfigurationError(
                "--moe-routing-replay: vLLM-CPU 0.32 cannot return routed experts (its "
                "--enable-return-routed-experts needs Model Runner V2, which needs Triton); serve on a GPU"
            )
        argv += ["--enable-return-routed-experts"]
    if options.api_key:
        guard_argv, guard_env = guard_additions(options.api_key, dict(os.environ))
        argv += guard_argv
        env.update(guard_env)
    argv += options.extra_args
    return argv, env


def server_environment(env_additions: dict[str, str]) -> dict[str, str]:
    """The server process's environment: this one's with `env_additions`; a VLLM_API_KEY of this
    environment reaches the server only through `ServerOptions.api_key` (in `env_additions`)."""
    inherited = {name: value for name, value in os.environ.items() if name != API_KEY_ENV}
    return {**inherited, **env_additions}


def format_command(argv: list[str], env: dict[str, str]) -> str:
    """The command as a shell line, for people and logs: secrets (the API key, a `--hf-token`) show
    as redacted."""
    shown_env = redact_env(env)
    return " ".join(
        [*(f"{key}={shlex.quote(value)}" for key, value in shown_env.items()), shlex.join(redact_argv(argv))]
    )


def guarded(argv: list[str]) -> list[str]:
    """`argv` under the guard (generation/guard.py): it runs in a process group of its own and is
    stopped when this process dies, however it dies (a SIGKILL included)."""
    return [sys.executable, "-m", "asyncgrpo.generation.guard", str(os.getpid()), "--", *argv]


class VLLMServer:
    """A `vllm serve` child process: `with VLLMServer(options) as server: ... server.url`.

    The server runs in its own process group so that stopping it also stops the engine processes
    it spawns; on exit it gets SIGTERM, then SIGKILL after `stop_timeout` seconds. It runs under the
    guard, so it also stops when this process dies without stopping it.
    """

    def __init__(
        self,
        options: ServerOptions,
        log_path: str | Path | None = None,
        start_timeout: float = 300.0,
        stop_timeout: float = 15.0,
    ):
        self.options = options
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="vllm-")) / "server.log"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return self.options.url

    def __enter__(self) -> "VLLMServer":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        """Launch the server and wait until it answers."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting: several servers launched first and then waited for start
        side by side (each start is mostly one process's CPU work)."""
        argv, env_additions = build_command(self.options)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {format_command(argv, env_additions)}\n".encode())
            self.process = subprocess.Popen(
                guarded(argv),
                env=server_environment(env_additions),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self) -> None:
        """Block until the launched server answers; on failure or timeout it is stopped."""
        try:
            self._poll_until_ready()
        except BaseException:
            self.stop()
            raise

    def _poll_until_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(
                    f"vllm serve exited with code {self.process.returncode} before it was ready; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                request = urllib.request.Request(
                    self.url + "/v1/models", headers=auth_headers(self.options.api_key)
                )
                with urllib.request.urlopen(request, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(
            f"vllm serve was not ready at {self.url} after {self.start_timeout:.0f} s; "
            f"last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        _signal_group(self.process, signal.SIGTERM)
        try:
            self.process.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            _signal_group(self.process, signal.SIGKILL)
            self.process.wait(timeout=self.stop_timeout)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def serve_foreground(options: ServerOptions) -> int:
    """`asyncgrpo serve`: print the exact command, run it, forward SIGINT/SIGTERM, return its code."""
    argv, env_additions = build_command(options)
    print(format_command(argv, env_additions), flush=True)
    process = subprocess.Popen(guarded(argv), env=server_environment(env_additions), start_new_session=True)

    def forward(signum, _frame):
        _signal_group(process, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                return process.wait()
            except KeyboardInterrupt:
                _signal_group(process, signal.SIGINT)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if process.poll() is None:
            _signal_group(process, signal.SIGKILL)
