"""Who may steer a server: its API key, on both sides.

A server in dev mode (which the trainer needs) takes orders on plain HTTP routes: pause, resume,
load weights from a path, relabel them. With a key, every route but liveness requires it
(server_plugins/asyncgrpo_route_guard.py, loaded by vLLM's `--middleware`); without one, anyone who
reaches the port steers the server, so a server bound beyond loopback must have a key unless the
user opts out by name (`--insecure-no-api-key`). The key travels to the server in its environment
(VLLM_API_KEY), never on a command line, which every user of the machine can read. On the calling
side, `auth_headers` is the one place a request gets the key. docs/security.md tells the whole story.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import stat
from pathlib import Path

from asyncgrpo.errors import ConfigurationError

API_KEY_ENV = "VLLM_API_KEY"
# The folder vLLM's Python gets on its PYTHONPATH: it holds the guard as a top-level module.
SERVER_PLUGINS_DIR = Path(__file__).resolve().parent / "server_plugins"
GUARD_MIDDLEWARE = "asyncgrpo_route_guard.RequireApiKey"
INSECURE_FLAG = "--insecure-no-api-key"
# vLLM front ends that answer requests without passing through the Python app's middleware.
_UNGUARDED_FRONTEND_FLAGS = ("--grpc", "--grpc-port")
_UNGUARDED_FRONTEND_ENV = "VLLM_USE_RUST_FRONTEND"
KEY_BYTES = 32


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only ("localhost", 127.0.0.0/8, ::1). Any other
    name counts as reachable from the network: a hostname is not resolved to decide."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_error(host: str, port: int, api_key: str | None, insecure: bool) -> str | None:
    """Why a server on `host` must not start as asked (None: it may)."""
    if api_key and insecure:
        return f"{INSECURE_FLAG} and an API key together: drop one of them"
    if api_key or insecure or is_loopback(host):
        return None
    return (
        f"--host {host or '(all interfaces)'} is reachable from other machines, and without an API key "
        f"anyone who reaches port {port} can pause the server, load other weights into it and relabel "
        "them. Give it a key: --generate-api-key FILE (a new key, written to FILE with mode 0600), "
        f"--api-key-file FILE, or {API_KEY_ENV} in the environment; the trainer then needs the same key "
        f"as {API_KEY_ENV}. To serve without a key anyway, add {INSECURE_FLAG} (docs/security.md)"
    )


def unguarded_frontend_error(extra_args: list[str], environ: dict[str, str]) -> str | None:
    """Why a keyed server cannot be started as asked: a front end the guard does not cover."""
    given = [flag for flag in _UNGUARDED_FRONTEND_FLAGS if any(a.split("=")[0] == flag for a in extra_args)]
    if environ.get(_UNGUARDED_FRONTEND_ENV, "").lower() not in ("", "0", "false"):
        given.append(f"{_UNGUARDED_FRONTEND_ENV}={environ[_UNGUARDED_FRONTEND_ENV]}")
    if not given:
        return None
    return (
        f"{', '.join(given)}: that front end answers requests without vLLM's HTTP middleware, so the "
        "API key would not guard it; serve over HTTP only"
    )


def read_api_key_file(path: str | os.PathLike) -> tuple[str, str | None]:
    """(the key in `path`, a warning when other users may read the file, else None)."""
    path = Path(path)
    try:
        key = path.read_text().strip()
    except OSError as error:
        raise ConfigurationError(f"--api-key-file {path}: cannot read it ({error.strerror})") from None
    if not key:
        raise ConfigurationError(f"--api-key-file {path}: the file is empty")
    mode = stat.S_IMODE(path.stat().st_mode)
    warning = None
    if mode & 0o077:
        warning = f"{path} can be read by other users (mode {mode:o}): `chmod 600 {path}`"
    return key, warning


def write_new_api_key(path: str | os.PathLike, dry_run: bool = False) -> str:
    """A fresh key, written to `path` (created with mode 0600; an existing file is refused, so a
    running job's key is never replaced by accident). `dry_run`: checked, not written."""
    path = Path(path)
    key = secrets.token_urlsafe(KEY_BYTES)
    exists = ConfigurationError(
        f"--generate-api-key {path}: the file exists; serve with --api-key-file {path}, or remove it "
        "for a new key"
    )
    if dry_run:
        if path.exists():
            raise exists
        return key
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise exists from None
    with os.fdopen(descriptor, "w") as file:
        file.write(key + "\n")
    return key


def guard_additions(api_key: str, environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The vLLM arguments and environment that make a server require `api_key` on every route but
    liveness: the guard middleware, its folder on the server's PYTHONPATH, the key in VLLM_API_KEY
    (which also turns on vLLM's own check of its /v1 routes)."""
    python_path = os.pathsep.join(filter(None, [str(SERVER_PLUGINS_DIR), environ.get("PYTHONPATH")]))
    return ["--middleware", GUARD_MIDDLEWARE], {API_KEY_ENV: api_key, "PYTHONPATH": python_path}


def auth_headers(api_key: str | None = None) -> dict[str, str]:
    """The one place a request to a server gets its credentials: `api_key`, else VLLM_API_KEY (vLLM's
    own convention), as a bearer token. Every HTTP call of the package to a server sends these
    headers (the client's session, the launcher's readiness poll): a server with a key answers
    nothing else but liveness (docs/security.md)."""
    key = api_key or os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


def unauthorized_message(url: str) -> str:
    """What to do when a server answered 401."""
    if os.environ.get(API_KEY_ENV):
        return (
            f"vLLM server {url} refused the API key in VLLM_API_KEY: set it to the key the server was "
            "started with"
        )
    return (
        f"vLLM server {url} requires an API key: set VLLM_API_KEY to the key it was started with "
        "(docs/security.md)"
    )
