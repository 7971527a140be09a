"""Shared fixtures: the tiny model and its tokenizer, and real `vllm serve` processes shared across the suite.

A vLLM CPU server takes ~30-45 s and ~3 GB to start, so there is one per distinct set of flags for
the whole session (`vllm_servers.get(...)`); tests that change a server's weights restore them.
"""

from __future__ import annotations

import os

# Nothing here downloads (tests build their models offline): a Hub lookup would only wait for a
# network timeout (~24 s each). Set before transformers and huggingface_hub read it at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import asyncio  # noqa: E402
import json
import signal
import socket
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest
import torch

# The suite's helper modules (agents, workers, doubles) live in tests/support. Test modules import helpers of
# other modules by name (the suite runs with pytest's default `prepend` import mode), across the folders too.
sys.path.insert(0, str(Path(__file__).resolve().parent / "integration"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "unit"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from gpu_limits import bound_gpu_tests, gpu_test_group, longest_first, one_config_autotune

from asyncgrpo import AsyncGRPOConfig
from asyncgrpo.cli.tiny_model import build_tokenizer, save_tiny_model
from asyncgrpo.run import cpu_use

if TYPE_CHECKING:  # the server module needs msgspec, which a GPU host may lack: imported where used
    from asyncgrpo.generation.server import VLLMServer

MAX_MODEL_LEN = 1024


def pytest_configure(config):
    # A CI timeout stops pytest with SIGTERM: turn it into KeyboardInterrupt so fixtures tear down
    # and no vLLM server outlives the run.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # One intra-op thread on CPU: the tests' models are tiny, so a second thread buys little, and while
    # anything else holds a core (a vLLM server generating or starting, a rollout worker, another job)
    # every parallel op waits at its barrier for the thread that lost its core: the IncrementEnv warm
    # start took minutes instead of seconds that way (docs/testing.md). The processes the tests start
    # (training scripts, launchers' ranks, CLIs, rollout workers) inherit the same through OpenMP's
    # variable, unless the caller set it.
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def in_parallel_worker() -> bool:
    """This process is one of several pytest-xdist workers (`make test` runs two)."""
    return "PYTEST_XDIST_WORKER" in os.environ


# Servers of the session pool that one worker should hold for all the modules that use it.
_SHARED_BY_MODULES = ("lora_server", "keyed_server")


def worker_groups(items) -> dict[Path, str]:
    """{module: the xdist group it runs in}: a module is a group of its own, except that modules using
    the same session server of `_SHARED_BY_MODULES`, and the modules marked `many_servers`, are joined
    into one group (transitively), so that one worker starts that server once and no two modules that
    each start several servers of their own run side by side (memory: docs/testing.md)."""
    labels: dict[Path, set[str]] = {}
    for item in items:
        module_labels = labels.setdefault(item.path, set())
        module_labels.update(name for name in _SHARED_BY_MODULES if name in item.fixturenames)
        if item.get_closest_marker("many_servers") is not None:
            module_labels.add("many_servers")
    joined: dict[str, str] = {}  # label -> the label that stands for its component

    def root(label: str) -> str:
        while joined.get(label, label) != label:
            label = joined[label]
        return label

    for module_labels in labels.values():
        first, *rest = sorted(module_labels) or [None]
        for label in rest:
            joined[root(label)] = root(first)
    components: dict[str, set[str]] = {}
    for label in {label for module_labels in labels.values() for label in module_labels}:
        components.setdefault(root(label), set()).add(label)
    return {
        path: "+".join(sorted(components[root(min(module_labels))])) if module_labels else path.stem
        for path, module_labels in labels.items()
    }


def in_group(item: pytest.Item, group: str) -> None:
    """Put `item` in xdist group `group`: the "@group" suffix of its node id is what the scheduler of
    `--dist loadgroup` reads. pytest-xdist 3.8 adds it from the `xdist_group` marker by setting the
    node's `_nodeid`, which pytest 9.2 no longer reads (its node ids live in `_id`): set here instead,
    and checked, so that a pytest that changes it again fails collection instead of scattering a
    module's tests over the workers."""
    try:
        from _pytest.nodeid import coerce_node_id
    except ImportError:  # an earlier pytest (9.1 on the GPU image) keeps them in `_nodeid`, as xdist sets
        item._nodeid = f"{item.nodeid}@{group}"
    else:
        item._id = coerce_node_id(f"{item.nodeid}@{group}")
    if not item.nodeid.endswith(f"@{group}"):
        raise pytest.UsageError(f"cannot put {item.nodeid} in an xdist group (tests/conftest.py, in_group)")


# {session server: the last test of the session that uses it} (the session's order).
_last_users: dict[str, pytest.Item] = {}


if torch.cuda.is_available():  # bounds on the GPU tests' time (tests/support/gpu_limits.py)
    one_config_autotune()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    needs_server = {}
    for item in items:
        needs_server[item.path] = (
            needs_server.get(item.path, False) or item.get_closest_marker("vllm") is not None
        )
    if in_parallel_worker():
        # Workers take whole groups in this order (`make test` passes --no-loadscope-reorder): the
        # modules with servers first, the joined group leading, and the many short modules that need
        # none last, where they even out the two workers' ends.
        groups = worker_groups(items)
        on_gpu = torch.cuda.is_available()
        for item in items:
            in_group(item, (on_gpu and gpu_test_group(item)) or groups[item.path])
        joined = {path: group != path.stem for path, group in groups.items()}
        items.sort(key=lambda item: (not needs_server[item.path], not joined[item.path]))
        if on_gpu:  # the long GPU tests first, side by side (tests/support/gpu_limits.py)
            items.sort(key=longest_first)
    else:
        # One process: the modules that need no server run first, each module's tests in their order,
        # and the servers the session will need start meanwhile (servers_launched_ahead).
        items.sort(key=lambda item: needs_server[item.path])
    _last_users.clear()
    for item in items:
        _last_users.update({name: item for name in _SHARED_BY_MODULES if name in item.fixturenames})
    if torch.cuda.is_available():
        bound_gpu_tests(items)
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
def tiny_model_dir(tmp_path_factory, running_server) -> Path:
    # With a server kept running (ASYNCGRPO_TEST_SERVER), the copy it serves: tests name the served
    # model by its directory.
    if running_server is not None:
        return running_server.model_dir
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
        self._starting: set[tuple] = set()  # launched ahead, not waited for yet

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
        keys = [self._key(**spec) for spec in specs]
        launched = self._launch_missing(keys)
        waiting = launched + [key for key in dict.fromkeys(keys) if key in self._starting]
        self._starting.difference_update(waiting)
        try:
            for key in waiting:
                self._servers[key].wait_ready()
        except BaseException:
            for key in waiting:
                self.release_key(key)
            raise
        return [self._servers[key] for key in keys]

    def launch_ahead(self, *specs: dict) -> None:
        """Start the missing servers of `specs` without waiting for them: the first `get` of each
        waits until it answers (or raises why it did not start)."""
        self._starting.update(self._launch_missing([self._key(**spec) for spec in specs]))

    def _launch_missing(self, keys: list[tuple]) -> list[tuple]:
        from asyncgrpo.generation.server import ServerOptions, VLLMServer

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
        return launched

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

    def adopt(self, server, **spec) -> None:
        """Use `server`, started outside this session, as the pool's server for `spec` (`get`'s
        arguments): it is never launched nor stopped here."""
        self._servers[self._key(**spec)] = server

    def release(self, *extra_args: str, **kwargs) -> None:
        """Stop a server with unusual flags once its tests are done, to free its ~3 GB."""
        self.release_key(self._key(extra_args, **kwargs))

    def release_key(self, key: tuple) -> None:
        self._starting.discard(key)
        server = self._servers.pop(key, None)
        if server is not None:
            server.stop()

    def stop_all(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()
        self._starting.clear()


# The fast loop for daily work (docs/testing.md): a server kept running between pytest runs stands in
# for the session's default server when this variable holds its URL, so a run of one test file against
# it pays for no server start.
RUNNING_SERVER_VARIABLE = "ASYNCGRPO_TEST_SERVER"
RUNNING_SERVER_COMMAND = (
    "asyncgrpo tiny-model DIR && asyncgrpo serve DIR --cpu --dtype float32 "
    f"--max-model-len {MAX_MODEL_LEN} --port PORT"
)


class RunningServer:
    """A server this session did not start: used like the pool's own, never stopped by it."""

    def __init__(self, url: str, model_dir: Path, pid: int | None):
        self.url = url
        self.model_dir = model_dir  # the tiny model's copy it serves
        # The root of its processes on this machine (the timeline test follows the server's processes).
        self.process = SimpleNamespace(pid=pid)

    def stop(self) -> None:
        """It belongs to whoever started it."""


def running_default_server(url: str, tiny_model: Path) -> RunningServer:
    """The server at `url`, once its `/server_info` shows the flags of the pool's default server and
    its model directory holds the files of `tiny_model` (a test run against another server would fail
    for reasons that are not the code's)."""
    url = url.rstrip("/")
    how = f"start one with `{RUNNING_SERVER_COMMAND}` and set {RUNNING_SERVER_VARIABLE}=http://127.0.0.1:PORT"
    try:
        with urllib.request.urlopen(f"{url}/server_info?config_format=json", timeout=30) as answer:
            config = json.load(answer)["vllm_config"]
    except (OSError, ValueError, KeyError) as error:
        raise RuntimeError(f"{url} answers no keyless dev-mode /server_info ({error}); {how}") from error
    model = config.get("model_config") or {}
    served = Path(str(model.get("model")))
    dtype = str(model.get("dtype")).removeprefix("torch.")
    settings = {"dtype": dtype, "max_model_len": model.get("max_model_len")}
    problems = [
        f"its {name} is {settings[name]!r}, not {wanted!r}"
        for name, wanted in (("dtype", "float32"), ("max_model_len", MAX_MODEL_LEN))
        if settings[name] != wanted
    ]
    if config.get("lora_config"):
        problems.append("it serves LoRA adapters")
    differ = [
        file.name
        for file in sorted(tiny_model.iterdir())
        if not (served / file.name).is_file() or (served / file.name).read_bytes() != file.read_bytes()
    ]
    if differ:
        problems.append(f"its model ({served}) is not the tiny model: {', '.join(differ)} differ")
    if problems:
        raise RuntimeError(f"{url} is not the suite's default server: {'; '.join(problems)}; {how}")
    asyncio.run(_serve_the_tiny_model(url, served))  # a run stopped mid-test may have left other weights
    pids = cpu_use.server_pids([url])
    parents = {pid: stat.parent for pid in pids if (stat := cpu_use.read_stat(pid)) is not None}
    roots = [pid for pid, parent in parents.items() if parent not in parents]
    return RunningServer(url, served, roots[0] if roots else None)


@pytest.fixture(scope="session")
def running_server(tmp_path_factory) -> RunningServer | None:
    """The server ASYNCGRPO_TEST_SERVER names, checked against a tiny model built here; None without it."""
    url = os.environ.get(RUNNING_SERVER_VARIABLE)
    if not url:
        return None
    if in_parallel_worker():
        # Two workers' tests would change its weights under each other.
        pytest.exit(f"{RUNNING_SERVER_VARIABLE} is for one pytest process: run pytest without -n", 2)
    return running_default_server(url, save_tiny_model(tmp_path_factory.mktemp("tiny-model-check")))


async def _serve_the_tiny_model(url: str, model_dir: Path) -> None:
    from asyncgrpo.generation.client import VLLMClient, policy_label

    async with VLLMClient(url, timeout=60) as client:
        await client.reload_weights(str(model_dir), version=policy_label(0))
        await client.reset_prefix_cache()


@pytest.fixture(scope="session")
def vllm_servers(tiny_model_dir, tmp_path_factory, running_server):
    pool = ServerPool(tiny_model_dir, tmp_path_factory.mktemp("vllm-logs"))
    if running_server is not None:
        pool.adopt(running_server)
    _session_pools.append(pool)
    yield pool
    _session_pools.remove(pool)
    pool.stop_all()


_session_pools: list[ServerPool] = []  # the session's pool, once a test has asked for it


def pytest_runtest_teardown(item, nextitem):
    # The LoRA and keyed servers stop after the last test that uses them, not at the session's end:
    # a parallel worker goes on to other modules, and the memory is better given back.
    for name, last in _last_users.items():
        if item is last and _session_pools:
            _session_pools[0].release(**SESSION_SERVERS[name])


# The key of the suite's keyed server (tests send it as VLLM_API_KEY). Made up for the tests: it
# guards a loopback server that lives as long as the test session.
TEST_API_KEY = "asyncgrpo-test-key-3f9c2a7d51e8"


# The servers that live as long as the session, by the fixture that gives each (`get`'s arguments).
SESSION_SERVERS = {
    "vllm_server": {},
    "lora_server": dict(enable_lora=True, max_lora_rank=8, max_loras=2),
    "keyed_server": dict(api_key=TEST_API_KEY),
}


@pytest.fixture(scope="session", autouse=True)
def servers_launched_ahead(request):
    """A server start keeps one core busy for half a minute (two processes in turn, each importing
    vLLM) while the test that asked for it waits. So the session's servers that its tests will ask for
    are launched before its first test, with no waiting: in one process they start while the modules
    that need no server run (those run first), and are up when the first test asks. A parallel worker
    does not know which modules it will be sent: it launches the default server alone, which every
    worker's first modules use; the others start when a test first asks."""
    names = ["vllm_server"] if in_parallel_worker() else list(SESSION_SERVERS)
    wanted = [
        SESSION_SERVERS[name]
        for name in names
        if any(name in item.fixturenames for item in request.session.items)
    ]
    if wanted:
        request.getfixturevalue("vllm_servers").launch_ahead(*wanted)


@pytest.fixture(scope="session")
def vllm_server(vllm_servers) -> VLLMServer:
    """The default server on the tiny model: what most integration tests share."""
    return vllm_servers.get(**SESSION_SERVERS["vllm_server"])


@pytest.fixture(scope="session")
def lora_server(vllm_servers) -> VLLMServer:
    """A server that loads LoRA adapters at run time (rank <= 8, two at once), shared by the LoRA tests
    of several modules. Those tests change adapters; the one that syncs merged weights into it puts the
    base weights back (restore_server)."""
    return vllm_servers.get(**SESSION_SERVERS["lora_server"])


@pytest.fixture(scope="session")
def keyed_server(vllm_servers) -> VLLMServer:
    """The tiny model's server started with an API key (`asyncgrpo serve --api-key-file`'s guard on
    every route but liveness): the security tests and the server-restart fault test share it."""
    return vllm_servers.get(**SESSION_SERVERS["keyed_server"])


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
