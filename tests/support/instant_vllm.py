"""A vLLM stand-in that answers at once: /v1/models and /v1/completions with random token ids and
top-N log-probs, as vLLM's token route writes them. It takes the server's cost out of a measurement
(bench/worker_throughput.py) or out of a test of the rollout side (tests/unit/test_worker_pool_resume.py).
It has no /metrics, so a worker's concurrency cap stays the user's bound."""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import os
import random
import socket

# Distinct bodies served in turn: enough that consecutive completions differ.
DISTINCT_BODIES = 32


def fake_completion_body(rng: random.Random, vocab: int, completion_tokens: int, top_n: int) -> bytes:
    token_ids = [rng.randrange(vocab) for _ in range(completion_tokens)]
    tops = []
    for token in token_ids:
        top = {f"token_id:{token}": -rng.random()}
        while len(top) < top_n + rng.randrange(2):
            top[f"token_id:{rng.randrange(vocab)}"] = -rng.random() * 5
        tops.append(top)
    choice = {
        "index": 0,
        "text": "",
        "logprobs": {
            "text_offset": list(range(completion_tokens)),
            "token_logprobs": [next(iter(top.values())) for top in tops],
            "tokens": [f"token_id:{t}" for t in token_ids],
            "top_logprobs": tops,
        },
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": token_ids,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
    }
    body = {"id": "cmpl", "object": "text_completion", "model": "m", "choices": [choice]}
    return json.dumps(body, separators=(",", ":")).encode()  # compact, as vLLM writes it


def _http_response(status: str, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


class _InstantHTTP(asyncio.Protocol):
    """HTTP/1.1 with keep-alive, just what the client sends (requests with a Content-Length body), and
    every answer encoded in advance. A real server runs on its own machine; this stand-in shares the
    benchmark's cores, so its cost per request is kept to parsing one header block (a web framework
    spent several times the CPU here, bench/RESULTS.md "worker_scaling")."""

    def __init__(self, completions: list[bytes], models: bytes, counter):
        self.completions, self.models, self.counter = completions, models, counter
        self.buffer = b""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buffer[:head_end].decode("latin-1").split("\r\n")
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buffer) < head_end + 4 + length:
                return  # the body is still on its way
            self.buffer = self.buffer[head_end + 4 + length :]
            method, path = head[0].split(" ")[:2]
            if method == "POST" and path == "/v1/completions":
                self.transport.write(self.completions[next(self.counter) % len(self.completions)])
            elif method == "GET" and path == "/v1/models":
                self.transport.write(self.models)
            else:  # /metrics among them: a worker's concurrency cap stays the user's bound
                self.transport.write(_http_response("404 Not Found", b'{"detail":"Not Found"}'))


def run_instant_server(port: int, vocab: int, completion_tokens: int, top_n: int, core: int | None) -> None:
    """Serve on `port` until killed (pinned to `core` when given)."""
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    rng = random.Random(0)
    completions = [
        _http_response("200 OK", fake_completion_body(rng, vocab, completion_tokens, top_n))
        for _ in range(DISTINCT_BODIES)
    ]
    models = _http_response("200 OK", json.dumps({"data": [{"id": "fake", "max_model_len": 4096}]}).encode())
    counter = itertools.count()

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: _InstantHTTP(completions, models, counter), "127.0.0.1", port
        )
        await server.serve_forever()

    asyncio.run(serve())


def start_instant_server(
    vocab: int, completion_tokens: int, top_n: int, core: int | None = None
) -> tuple[str, multiprocessing.Process]:
    """(its URL, its process): a daemon process, so it dies with the caller at worst."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = multiprocessing.get_context("spawn").Process(
        target=run_instant_server, args=(port, vocab, completion_tokens, top_n, core), daemon=True
    )
    process.start()
    return f"http://127.0.0.1:{port}", process
