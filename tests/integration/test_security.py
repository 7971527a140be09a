"""Servers only their run can steer (docs/security.md): with a key, every route of a server but
liveness answers 401 without it; the trainer sends it on every call; `asyncgrpo serve` refuses a
server open to the network; no key or secret reaches a printed command, a log or the run directory."""

from __future__ import annotations

import ast
import asyncio
import json
import logging
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from support_paths import SUPPORT

pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

from conftest import TEST_API_KEY, make_config  # noqa: E402
from test_trainer_e2e import prompts, token_parity_reward  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from asyncgrpo.cli.main import main  # noqa: E402
from asyncgrpo.cli.train_command import write_resolved_config  # noqa: E402
from asyncgrpo.generation.client import VLLMAuthenticationError, VLLMClient, policy_label  # noqa: E402
from asyncgrpo.generation.server import ServerOptions, build_command, format_command  # noqa: E402
from asyncgrpo.generation.server_auth import SERVER_PLUGINS_DIR, is_loopback  # noqa: E402
from asyncgrpo.run.redaction import REDACTED, redact_argv, redact_config, redact_text  # noqa: E402

GUARD_FILE = SERVER_PLUGINS_DIR / "asyncgrpo_route_guard.py"
APP_ROUTES_SCRIPT = SUPPORT / "vllm_app_routes.py"
# Every route a trainer steers a server with, or that reveals what the server runs: each must answer
# 401 without the key. (The enumeration test below covers every other route the server has.)
CONTROL_ROUTES = [
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("GET", "/is_paused"),
    ("POST", "/collective_rpc"),
    ("POST", "/update_weight_version"),
    ("GET", "/weight_info"),
    ("POST", "/init_weight_transfer_engine"),
    ("POST", "/start_weight_update"),
    ("POST", "/update_weights"),
    ("POST", "/finish_weight_update"),
    ("POST", "/shutdown_weight_transfer_engine"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("POST", "/abort_requests"),
    ("GET", "/server_info"),
    ("GET", "/get_world_size"),
    ("GET", "/metrics"),
    ("GET", "/load"),
    ("GET", "/version"),
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/inference/v1/generate"),
    ("POST", "/tokenize"),
    ("GET", "/openapi.json"),
]
LIVENESS_ROUTES = [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # build_command reads a made-up model's config


# -- the guard itself (it runs in the server's Python) ------------------------------------------------


def test_the_guard_imports_the_standard_library_only():
    imported = set()
    for node in ast.walk(ast.parse(GUARD_FILE.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported - {"__future__"} <= set(sys.stdlib_module_names), imported


def _asgi_call(guard, scope: dict) -> tuple[list[dict], bool]:
    """(what the guard sent, whether it passed the request on to the app)."""
    sent, passed = [], []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    async def run():
        await guard(scope, receive, send)

    guard.app = lambda scope, receive, send: _passed(passed)
    asyncio.run(run())
    return sent, bool(passed)


async def _passed(passed: list) -> None:
    passed.append(True)


def _guard(monkeypatch, key: str | None = TEST_API_KEY):
    monkeypatch.syspath_prepend(str(SERVER_PLUGINS_DIR))
    import asyncgrpo_route_guard

    if key is None:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    else:
        monkeypatch.setenv("VLLM_API_KEY", key)
    return asyncgrpo_route_guard.RequireApiKey(app=None)


def _http(path: str, method: str = "GET", authorization: str | None = None, root_path: str = "") -> dict:
    headers = [(b"host", b"server")]
    if authorization is not None:
        headers.append((b"authorization", authorization.encode()))
    return {"type": "http", "method": method, "path": path, "root_path": root_path, "headers": headers}


def test_the_guard_passes_only_the_key_except_liveness(monkeypatch):
    guard = _guard(monkeypatch)
    for scope in (
        _http("/pause", "POST"),
        _http("/pause", "POST", f"Bearer {TEST_API_KEY}x"),
        _http("/pause", "POST", f"Basic {TEST_API_KEY}"),
        _http("/collective_rpc", "OPTIONS"),
        _http("/health", "POST"),  # liveness is GET/HEAD only
        _http("/health/../pause", "POST"),
        _http("/api/pause", "POST", root_path="/api"),
    ):
        sent, passed = _asgi_call(guard, scope)
        assert not passed and sent[0]["status"] == 401, scope
        assert b"Bearer" in dict(sent[0]["headers"])[b"www-authenticate"]
    for scope in (
        _http("/pause", "POST", f"Bearer {TEST_API_KEY}"),
        _http("/pause", "POST", f"bearer  {TEST_API_KEY} "),
        _http("/health"),
        _http("/ping", "POST"),
        _http("/api/health", root_path="/api"),
        {"type": "lifespan"},
    ):
        assert _asgi_call(guard, scope) == ([], True), scope
    sent, passed = _asgi_call(guard, {"type": "websocket", "path": "/v1/realtime", "headers": []})
    assert not passed and sent == [{"type": "websocket.close", "code": 1008}]


def test_the_guard_refuses_to_start_without_a_key(monkeypatch):
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is not set"):
        _guard(monkeypatch, key=None)
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is not set"):
        _guard(monkeypatch, key="  ")


# -- `asyncgrpo serve`: no server open by accident, no key printed ---------------------------------------


@pytest.fixture
def no_server_start(monkeypatch):
    """Fails the test if anything tries to start a process (a refused serve must not)."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[0] if args else kwargs}")

    monkeypatch.setattr(subprocess, "Popen", refuse)


def _config(tmp_path: Path, model: str, url: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {model}\nvllm_server_base_url: {url}\ndataset: {{data_files: x.jsonl}}\n")
    return path


def test_is_loopback():
    assert all(map(is_loopback, ["127.0.0.1", "127.0.1.1", "localhost", "::1", "[::1]"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "", "10.0.0.5", "node12", "192.168.1.2"]))


def test_serve_beyond_loopback_without_a_key_refuses_and_says_how(
    no_server_start, monkeypatch, capsys, tmp_path, tiny_model_dir
):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert main(["serve", str(tiny_model_dir), "--host", "0.0.0.0", "--cpu"]) == 2
    message = capsys.readouterr().err
    for advice in ("--generate-api-key", "--api-key-file", "VLLM_API_KEY", "--insecure-no-api-key"):
        assert advice in message
    assert "port 8000" in message and "docs/security.md" in message
    # --for: the host comes from the config's URL, and the same rule holds.
    config = _config(tmp_path, str(tiny_model_dir), "http://0.0.0.0:8011")
    assert main(["serve", "--for", str(config), "--cpu", "--dry-run"]) == 2
    assert "--host 0.0.0.0" in capsys.readouterr().err
    # The opt-out by name, and loopback, start (shown with --dry-run).
    assert main(["serve", "--for", str(config), "--cpu", "--dry-run", "--insecure-no-api-key"]) == 0
    assert "--host 0.0.0.0" in capsys.readouterr().out
    loopback = _config(tmp_path, str(tiny_model_dir), "http://127.0.0.1:8011")
    assert main(["serve", "--for", str(loopback), "--cpu", "--dry-run"]) == 0
    assert "--middleware" not in capsys.readouterr().out  # no key, no guard
    # A key and the opt-out together are a contradiction.
    monkeypatch.setenv("VLLM_API_KEY", TEST_API_KEY)
    assert main(["serve", "--for", str(config), "--cpu", "--dry-run", "--insecure-no-api-key"]) == 2


def test_the_key_reaches_the_server_in_its_environment_and_is_never_printed(
    monkeypatch, capsys, tmp_path, tiny_model_dir
):
    config = _config(tmp_path, str(tiny_model_dir), "http://0.0.0.0:8011")
    monkeypatch.setenv("VLLM_API_KEY", TEST_API_KEY)
    assert main(["serve", "--for", str(config), "--cpu", "--dry-run"]) == 0
    printed = capsys.readouterr()
    assert TEST_API_KEY not in printed.out + printed.err
    assert f"VLLM_API_KEY={REDACTED}" in printed.out.replace("'", "")
    assert "--middleware asyncgrpo_route_guard.RequireApiKey" in printed.out
    monkeypatch.delenv("VLLM_API_KEY")
    # --api-key: taken off the command line, into the environment; a warning, never the key.
    argv = ["serve", "--for", str(config), "--cpu", "--dry-run", "--api-key", TEST_API_KEY]
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert TEST_API_KEY not in printed.out + printed.err and "--api-key" not in printed.out
    assert "prefer --api-key-file" in printed.err
    options = ServerOptions(model=str(tiny_model_dir), host="0.0.0.0", cpu=True, api_key=TEST_API_KEY)
    server_argv, env = build_command(options)
    assert TEST_API_KEY not in " ".join(server_argv) and env["VLLM_API_KEY"] == TEST_API_KEY
    assert TEST_API_KEY not in repr(options)
    # --generate-api-key: a new key in a 0600 file, its path printed, the key not; never overwritten.
    key_file = tmp_path / "server.key"
    argv = ["serve", "--for", str(config), "--cpu", "--dry-run", "--generate-api-key", str(key_file)]
    assert main(argv) == 0 and not key_file.exists(), "a dry run writes nothing"
    capsys.readouterr()
    from asyncgrpo.generation.server_auth import write_new_api_key

    key = write_new_api_key(key_file)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and len(key) >= 40
    assert main(argv) == 2 and "the file exists" in capsys.readouterr().err
    # --api-key-file reads it; a file other users can read gets a warning.
    key_file.chmod(0o644)
    assert main(["serve", "--for", str(config), "--cpu", "--dry-run", "--api-key-file", str(key_file)]) == 0
    printed = capsys.readouterr()
    assert key not in printed.out + printed.err and "chmod 600" in printed.err


def test_a_key_among_vllms_arguments_or_an_unguarded_front_end_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="--api-key among vLLM's arguments"):
        build_command(ServerOptions(model="m", cpu=True, extra_args=["--api-key", "k"]))
    for extra, env in ((["--grpc"], {}), (["--grpc-port=50051"], {}), ([], {"VLLM_USE_RUST_FRONTEND": "1"})):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match="the API key would not guard it"):
            build_command(ServerOptions(model="m", cpu=True, api_key="k" * 12, extra_args=extra))
        for name in env:
            monkeypatch.delenv(name)


# -- secrets in commands, configs and logs --------------------------------------------------------------


def test_secrets_are_redacted_in_commands_configs_and_log_lines(monkeypatch, tmp_path):
    assert redact_argv(["--api-key", "k1", "--hf-token=t1", "--max-tokens", "16", "--seed", "3"]) == [
        "--api-key", REDACTED, f"--hf-token={REDACTED}", "--max-tokens", "16", "--seed", "3",
    ]  # fmt: skip
    shown = format_command(
        ["vllm", "serve", "m", "--api-key", "k1"], {"VLLM_API_KEY": "k2", "HF_HUB_OFFLINE": "1"}
    )
    assert "k1" not in shown and "k2" not in shown and "HF_HUB_OFFLINE=1" in shown
    config = {
        "model": "m",
        "max_tokens": 16,
        "token_budget": 256,
        "hub_token": "hf_abc",
        "vllm_server_base_url": ["http://user:pw@srv:8000", "http://srv2:8000"],
        "harness_session_factory": {"command": ["python", "a.py"], "env": {"GITHUB_TOKEN": "g", "MODE": "m"}},
    }
    redacted = redact_config(config)
    assert (
        redacted["hub_token"] == REDACTED and redacted["max_tokens"] == 16 and redacted["token_budget"] == 256
    )
    assert redacted["vllm_server_base_url"] == [f"http://user:{REDACTED}@srv:8000", "http://srv2:8000"]
    assert redacted["harness_session_factory"]["env"] == {"GITHUB_TOKEN": REDACTED, "MODE": REDACTED}
    assert redacted["harness_session_factory"]["command"] == ["python", "a.py"]
    # config.yaml in the run directory: the config as run, redacted.
    run = SimpleNamespace(raw=config, args=SimpleNamespace(output_dir=str(tmp_path / "run")))
    written = write_resolved_config(run).read_text()
    assert "hf_abc" not in written and "pw@" not in written and "GITHUB_TOKEN: <redacted>" in written
    # Log lines: the current value of any secret-named variable is blanked, whatever quotes it.
    monkeypatch.setenv("VLLM_API_KEY", TEST_API_KEY)
    assert redact_text(f"401 from http://srv:8000 with Bearer {TEST_API_KEY}") == (
        f"401 from http://srv:8000 with Bearer {REDACTED}"
    )


# -- against the suite's keyed server -----------------------------------------------------------------


def _status(url: str, method: str, key: str | None = None) -> int:
    request = urllib.request.Request(url, method=method, data=b"{}" if method in ("POST", "PUT") else None)
    request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.mark.vllm
def test_every_control_route_answers_401_without_the_key(keyed_server, monkeypatch):
    refused = {
        (method, path): (
            _status(keyed_server.url + path, method),
            _status(keyed_server.url + path, method, "x"),
        )
        for method, path in CONTROL_ROUTES
    }
    assert all(codes == (401, 401) for codes in refused.values()), refused
    assert not _is_paused(keyed_server.url), "no refused call reached the server"
    for method, path in LIVENESS_ROUTES:
        assert _status(keyed_server.url + path, method) == 200, path
    # With the key the same routes answer (read-only ones here).
    for path in ("/is_paused", "/server_info", "/weight_info", "/metrics", "/v1/models"):
        assert _status(keyed_server.url + path, "GET", TEST_API_KEY) == 200, path
    # The client raises a clear error on a 401 rather than taking it for a missing route.
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(VLLMAuthenticationError, match="requires an API key: set VLLM_API_KEY"):
        asyncio.run(_server_info_without_key(keyed_server.url))
    # The server's log (the launch line `VLLMServer` writes, and vLLM's own) never shows the key.
    log = keyed_server.log_path.read_text(errors="replace")
    assert TEST_API_KEY not in log and "VLLM_API_KEY='<redacted>'" in log


def _is_paused(url: str) -> bool:
    request = urllib.request.Request(url + "/is_paused", headers={"Authorization": f"Bearer {TEST_API_KEY}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["is_paused"]


async def _server_info_without_key(url: str):
    async with VLLMClient(url, timeout=30) as client:
        return await client.server_info()


@pytest.mark.vllm
def test_every_route_the_server_has_is_guarded_but_liveness(keyed_server):
    # The routes of vLLM's own app, built by vLLM from the server's arguments and environment in a
    # Python where asyncgrpo cannot be imported (as on a GPU cluster's server environment), joined
    # with the running server's /openapi.json: a route a newer vLLM adds is sent here too.
    from asyncgrpo.generation.server import server_environment

    argv, env_additions = build_command(keyed_server.options)
    environment = server_environment(env_additions)
    answer = subprocess.run(
        [sys.executable, str(APP_ROUTES_SCRIPT), *argv[argv.index("serve") + 1 :]],
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert answer.returncode == 0, answer.stderr[-3000:]
    app = json.loads(answer.stdout.strip().splitlines()[-1])
    routes = {(method, route["path"]) for route in app["routes"] for method in route["methods"] or ["GET"]}
    request = urllib.request.Request(
        keyed_server.url + "/openapi.json", headers={"Authorization": f"Bearer {TEST_API_KEY}"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        schema = json.loads(response.read())
    routes |= {(method.upper(), path) for path, item in schema["paths"].items() for method in item}
    assert set(CONTROL_ROUTES) <= routes, set(CONTROL_ROUTES) - routes
    assert len(routes) > 50
    open_routes = set()
    for method, path in sorted(routes):
        url = keyed_server.url + path.replace("{", "").replace(
            "}", ""
        )  # /v1/responses/{id} -> /v1/responses/id
        if _status(url, method) != 401:
            open_routes.add((method, path))
    assert open_routes <= set(LIVENESS_ROUTES) | {("HEAD", "/health"), ("HEAD", "/ping")}, open_routes
    assert app["middleware"][0] == "asyncgrpo_route_guard.RequireApiKey", "the guard is the outermost layer"


class WarnWithTheKey(TrainerCallback):
    """A warning that quotes the key (as an error message might): warnings.log must show it redacted."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            logging.getLogger("asyncgrpo.test").warning("a message quoting the key %s", TEST_API_KEY)


@pytest.mark.vllm
def test_a_run_trains_syncs_and_evaluates_with_the_key_and_its_files_hold_no_key(
    keyed_server, tiny_model_dir, tmp_path, monkeypatch
):
    from datasets import Dataset

    from asyncgrpo import AsyncGRPOTrainer

    monkeypatch.setenv("VLLM_API_KEY", TEST_API_KEY)
    output = tmp_path / "run"
    args = make_config(
        keyed_server, output, max_steps=2, eval_strategy="steps", eval_steps=2, num_generations_eval=2,
        hub_token="hf_not_a_real_token_123",
    )  # fmt: skip
    eval_rows = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Say a word."}]] * 2})
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir), token_parity_reward, args, train_dataset=prompts(),
        eval_dataset=eval_rows, callbacks=[WarnWithTheKey()],
    )  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 2

    async def labels():
        async with VLLMClient(keyed_server.url, timeout=60) as client:
            return await client.weight_labels()

    assert asyncio.run(labels()) == [policy_label(2)], "the weights of step 2 were synced"
    logged = trainer.state.log_history
    assert any("rollout/vllm_kv_cache_usage_frac" in entry for entry in logged), "/metrics was read"
    assert any("eval_reward" in entry for entry in logged), "the evaluator sampled"
    files = [path for path in output.rglob("*") if path.is_file() and path.stat().st_size < 50_000_000]
    assert {"config.json", "warnings.log", "metrics.jsonl"} <= {path.name for path in files}
    for path in files:
        content = path.read_bytes()
        assert TEST_API_KEY.encode() not in content and b"hf_not_a_real_token" not in content, path
    assert f"quoting the key {REDACTED}" in (output / "warnings.log").read_text()
