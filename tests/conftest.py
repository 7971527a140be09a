"""Shared fixtures: the tiny model and its tokenizer, and real `vllm serve` processes shared across the suite.

A vLLM CPU server takes ~30-45 s and ~3 GB to start, so there is one per distinct set of flags for
the whole session (`vllm_servers.get(...)`); tests that change a server's weights restore them.
"""

from __future__ import annotations

import os

# Nothing here downloads (tests build their models offline): a Hub lookup would only wait for a
# network timeout (~24 s each). Set before transformers and huggingface_hub read it at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import signal  # noqa: E402
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from asyncgrpo import AsyncGRPOConfig
from asyncgrpo.cli.tiny_model import build_tokenizer, save_tiny_model

if TYPE_CHECKING:  # the server module needs msgspec, which a GPU host may lack: imported where used
    from asyncgrpo.generation.server import VLLMServer

MAX_MODEL_LEN = 1024


def pytest_configure(config):
    # A CI timeout stops pytest with SIGTERM: turn it into KeyboardInterrupt so fixtures tear down
    # and no vLLM server outlives the run.
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny model's tokenizer (its chat template is the Qwen3 training template), one per module."""
    return build_tokenizer()


class ServerPool:
    """Servers keyed by their flags, started on first use, stopped at the end of the session."""

    def __init__(self, model_dir: Path, log_dir: Path):
        self.model_dir = model_dir
        self.log_dir = log_dir
        self._servers: dict[tuple, VLLMServer] = {}

    def get(
        self,
        *extra_args: str,
        enable_lora: bool = False,
        max_lora_rank=None,
        max_loras=None,
        model_dir: Path | None = None,
        dtype: str | None = "float32",
        api_key: str | None = None,
    ) -> VLLMServer:
        """`model_dir`: another model than the tiny Qwen3; `dtype=None` lets `asyncgrpo serve` pick;
        `api_key`: every route but liveness requires it."""
        return self.get_together(
            dict(
                extra_args=extra_args,
                enable_lora=enable_lora,
                max_lora_rank=max_lora_rank,
                max_loras=max_loras,
                model_dir=model_dir,
                dtype=dtype,
                api_key=api_key,
            )
        )[0]

    def get_together(self, *specs: dict) -> list[VLLMServer]:
        """Several servers (each spec: `get`'s arguments, `extra_args` as a tuple), the missing ones
        launched side by side: two starts on the two cores take about as long as one."""
        from asyncgrpo.generation.server import ServerOptions, VLLMServer

        keys = [self._key(**spec) for spec in specs]
        launched = []
        for key in keys:
            if key in self._servers:
                continue
            extra_args, enable_lora, max_lora_rank, max_loras, model_dir, dtype, api_key = key
            options = ServerOptions(
                model=str(model_dir or self.model_dir),
                port=free_port(),
                max_model_len=MAX_MODEL_LEN,
                dtype=dtype,
                cpu=True,
                enable_lora=enable_lora,
                max_lora_rank=max_lora_rank,
                max_loras=max_loras,
                extra_args=list(extra_args),
                api_key=api_key,
            )
            server = VLLMServer(options, log_path=self.log_dir / f"server-{len(self._servers)}.log")
            server.launch()
            self._servers[key] = server
            launched.append(key)
        try:
            for key in launched:
                self._servers[key].wait_ready()
        except BaseException:
            for key in launched:
                self.release_key(key)
            raise
        return [self._servers[key] for key in keys]

    @staticmethod
    def _key(
        extra_args: tuple = (),
        enable_lora: bool = False,
        max_lora_rank=None,
        max_loras=None,
        model_dir: Path | None = None,
        dtype: str | None = "float32",
        api_key: str | None = None,
    ) -> tuple:
        return (tuple(extra_args), enable_lora, max_lora_rank, max_loras, model_dir, dtype, api_key)

    def release(self, *extra_args: str, **kwargs) -> None:
        """Stop a server with unusual flags once its tests are done, to free its ~3 GB."""
        self.release_key(self._key(extra_args, **kwargs))

    def release_key(self, key: tuple) -> None:
        server = self._servers.pop(key, None)
        if server is not None:
            server.stop()

    def stop_all(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()


@pytest.fixture(scope="session")
def vllm_servers(tiny_model_dir, tmp_path_factory):
    pool = ServerPool(tiny_model_dir, tmp_path_factory.mktemp("vllm-logs"))
    yield pool
    pool.stop_all()


@pytest.fixture(scope="session")
def vllm_server(vllm_servers) -> VLLMServer:
    """The default server on the tiny model: what most integration tests share."""
    return vllm_servers.get()


@pytest.fixture(scope="session")
def lora_server(vllm_servers) -> VLLMServer:
    """A server that loads LoRA adapters at run time (rank <= 8, two at once), shared by the LoRA tests
    of several modules. Those tests change adapters; the one that syncs merged weights into it puts the
    base weights back (restore_server)."""
    return vllm_servers.get(enable_lora=True, max_lora_rank=8, max_loras=2)


# The key of the suite's keyed server (tests send it as VLLM_API_KEY). Made up for the tests: it
# guards a loopback server that lives as long as the test session.
TEST_API_KEY = "asyncgrpo-test-key-3f9c2a7d51e8"


@pytest.fixture(scope="session")
def keyed_server(vllm_servers) -> VLLMServer:
    """The tiny model's server started with an API key (`asyncgrpo serve --api-key-file`'s guard on
    every route but liveness): the security tests and the server-restart fault test share it."""
    return vllm_servers.get(api_key=TEST_API_KEY)


def make_config(server, output_dir, config_class=AsyncGRPOConfig, **overrides) -> AsyncGRPOConfig:
    """The config every integration test starts from (tests and the scripts they spawn import it
    from here): a short, quiet run against `server` on the tiny model; `overrides` change fields."""
    options = dict(
        output_dir=str(output_dir),
        vllm_server_base_url=server.url,
        num_generations=4,
        max_completion_length=16,
        token_budget=256,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        vllm_server_timeout=60,
        seed=0,
    )
    options.update(overrides)
    return config_class(**options)
