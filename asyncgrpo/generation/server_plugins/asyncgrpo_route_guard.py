"""ASGI middleware for a vLLM server: every route answers only a request that carries the server's
API key, except the liveness probes. vLLM loads it itself (`--middleware
asyncgrpo_route_guard.RequireApiKey`, which `asyncgrpo serve` adds when the server has a key).

vLLM's own `--api-key` check guards the paths under /v1, /v2, /inference and /cohere only; the
routes a trainer steers a server with (/pause, /resume, /collective_rpc, /update_weight_version, the
weight-transfer routes, /server_info...) stay open. This guard denies by default: a route that a
newer vLLM adds is guarded without a change here. Open: `OPEN_ROUTES`, which say only that the
server is alive (what Kubernetes probes, SageMaker and load balancers' health checks call).

It runs in the server's Python, often another environment than the trainer's, so it imports the
standard library only. The key comes from the server's VLLM_API_KEY (vLLM's own variable: never
from the command line, where any user of the machine could read it); a server given this middleware
without a key fails to start rather than run open. Keys are compared as SHA-256 digests with
`hmac.compare_digest`: the time a comparison takes says nothing about the key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

API_KEY_ENV = "VLLM_API_KEY"
# path -> methods answered without a key: liveness only (vLLM's /health, SageMaker's /ping).
OPEN_ROUTES = {"/health": ("GET", "HEAD"), "/ping": ("GET", "HEAD", "POST")}
_UNAUTHORIZED_BODY = json.dumps(
    {
        "error": {
            "message": "this server requires its API key: send `Authorization: Bearer <key>` "
            "(asyncgrpo sends $VLLM_API_KEY)",
            "type": "Unauthorized",
            "code": 401,
        }
    }
).encode()
# WebSocket close code for a policy violation: the handshake is refused (HTTP 403) before any data.
_WS_POLICY_VIOLATION = 1008


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8")).digest()


class RequireApiKey:
    """Pure ASGI middleware (no framework import): `RequireApiKey(app)`, as vLLM's
    `app.add_middleware` builds it."""

    def __init__(self, app) -> None:
        key = os.environ.get(API_KEY_ENV, "")
        if not key.strip():
            raise RuntimeError(
                f"asyncgrpo_route_guard: {API_KEY_ENV} is not set in the server's environment; the "
                "server would answer anyone. Set it, or start the server without this middleware"
            )
        self.app = app
        self._key_digest = _digest(key)

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether the `Authorization: Bearer <key>` header holds the key (constant time)."""
        given = next((value for name, value in headers if name.lower() == b"authorization"), b"")
        scheme, _, token = given.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(_digest(token.strip()), self._key_digest)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan: the server's own start and stop
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        root_path = scope.get("root_path", "")
        if root_path and path.startswith(root_path):
            path = path[len(root_path) :] or "/"
        open_methods = OPEN_ROUTES.get(path, ())
        if scope["type"] == "http" and scope.get("method") in open_methods:
            await self.app(scope, receive, send)
            return
        if self.authorized(scope.get("headers") or []):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": _WS_POLICY_VIOLATION})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(_UNAUTHORIZED_BODY)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _UNAUTHORIZED_BODY})
