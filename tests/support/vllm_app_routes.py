"""`python vllm_app_routes.py VLLM_SERVE_ARGS...`: build the FastAPI app that `vllm serve` would serve
with these arguments (vLLM's own parser and `build_app`, no engine), with asyncgrpo made unimportable,
as in a server environment without it; print one JSON object: every route (path, methods, and
whether it is a mount or a websocket) and the middleware classes the app runs.

It proves that vLLM's `--middleware` loader imports the guard from the folder `asyncgrpo serve` puts
on PYTHONPATH, without asyncgrpo, and lists the routes a server really has, so that the security
test sends each of them to the running server without a key.
"""

from __future__ import annotations

import json
import sys

sys.modules["asyncgrpo"] = None  # any `import asyncgrpo...` now raises ImportError

from starlette.routing import Mount, WebSocketRoute  # noqa: E402
from vllm.entrypoints.launchers.app import build_app  # noqa: E402
from vllm.entrypoints.launchers.cli_args import make_arg_parser  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402


def main(argv: list[str]) -> None:
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    app = build_app(args, ("generate",))
    app.build_middleware_stack()  # instantiates every middleware: the guard reads its key here
    routes = []
    for route in app.routes:
        kind = (
            "mount"
            if isinstance(route, Mount)
            else "websocket"
            if isinstance(route, WebSocketRoute)
            else "http"
        )
        routes.append(
            {"path": route.path, "methods": sorted(getattr(route, "methods", None) or []), "kind": kind}
        )
    middleware = [f"{m.cls.__module__}.{m.cls.__qualname__}" for m in app.user_middleware]
    print(json.dumps({"routes": routes, "middleware": middleware}))


if __name__ == "__main__":
    main(sys.argv[1:])
