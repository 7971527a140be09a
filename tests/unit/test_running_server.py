"""The suite's fast loop: a server started outside the session (ASYNCGRPO_TEST_SERVER) stands in for the
default server only if it is one, and the refusal says what differs and how to start the right one."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import MAX_MODEL_LEN, RUNNING_SERVER_COMMAND, running_default_server


def answering_server_info(config: dict) -> ThreadingHTTPServer:
    """A loopback HTTP server whose `/server_info` answers `{"vllm_config": config}`."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"vllm_config": config}).encode()
            self.send_response(200 if self.path.startswith("/server_info") else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_server_with_other_flags_or_weights_is_refused_with_the_command_to_start_one(
    tiny_model_dir, tmp_path
):
    other_model = tmp_path / "other"
    other_model.mkdir()
    (other_model / "model.safetensors").write_bytes(b"not the tiny model")
    config = {
        "model_config": {"model": str(other_model), "dtype": "torch.bfloat16", "max_model_len": 4096},
        "lora_config": {"max_lora_rank": 8},
    }
    server = answering_server_info(config)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(RuntimeError) as refused:
            running_default_server(url, tiny_model_dir)
    finally:
        server.shutdown()
    message = str(refused.value)
    assert "dtype is 'bfloat16', not 'float32'" in message
    assert f"max_model_len is 4096, not {MAX_MODEL_LEN}" in message
    assert "LoRA" in message and "model.safetensors" in message and RUNNING_SERVER_COMMAND in message


def test_no_server_at_the_url_is_refused_with_the_command_to_start_one(tiny_model_dir):
    server = answering_server_info({})
    url = f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()  # nothing listens there any more
    with pytest.raises(RuntimeError, match="answers no keyless dev-mode /server_info") as refused:
        running_default_server(url, tiny_model_dir)
    assert RUNNING_SERVER_COMMAND in str(refused.value)
