"""nginx as a zero-cost non-streaming backend: it answers every chat request with one fixed completion.

A Python replica answering at full speed costs more CPU than the fronts we measure in front of it; nginx with one
worker answers ~100k requests/s on one core, so whatever a front adds is the front's own cost.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from simulator.fleet import LOOPBACK, Process, base_url, free_port, start_process

MODEL = "bench-model"

# What an OpenAI-compatible engine answers, with a `usage` object (the gateway reads it) but without
# `prompt_tokens_details`, which not every engine sends.
COMPLETION = {
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 1700000000, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello from the zero-cost backend."},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 480, "completion_tokens": 8, "total_tokens": 488},
}
MODELS = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}


def nginx_installed() -> bool:
    return shutil.which("nginx") is not None


def _quoted(body: object) -> str:
    """A JSON document as an nginx string literal (single quotes; compact JSON has none to escape)."""
    text = json.dumps(body, separators=(",", ":"))
    assert "'" not in text and "\\" not in text, text
    return f"'{text}'"


def nginx_config(directory: Path, port: int) -> str:
    """A complete nginx.conf: one worker on `LOOPBACK:port`, every path under `directory`, no access log."""
    temp = directory / "temp"
    return f"""\
daemon off;
master_process on;
worker_processes 1;
pid {directory / "nginx.pid"};
error_log {directory / "error.log"} warn;
events {{
    worker_connections 4096;
}}
http {{
    access_log off;
    keepalive_requests 10000000;
    keepalive_timeout 300s;
    client_body_temp_path {temp / "body"};
    proxy_temp_path {temp / "proxy"};
    fastcgi_temp_path {temp / "fastcgi"};
    uwsgi_temp_path {temp / "uwsgi"};
    scgi_temp_path {temp / "scgi"};
    server {{
        listen {LOOPBACK}:{port} reuseport;
        default_type application/json;
        location = /health {{
            return 200 '';
        }}
        location = /v1/models {{
            return 200 {_quoted(MODELS)};
        }}
        # Nothing to scrape: an OpenAI-compatible engine without load metrics.
        location = /metrics {{
            return 404;
        }}
        location / {{
            return 200 {_quoted(COMPLETION)};
        }}
    }}
}}
"""


def start_nginx(directory: Path) -> Process:
    """nginx serving `nginx_config` from `directory` (the caller's temporary directory) on a free port."""
    port = free_port()
    (directory / "temp").mkdir(parents=True, exist_ok=True)
    config = directory / "nginx.conf"
    config.write_text(nginx_config(directory, port), encoding="utf-8")
    argv = ["nginx", "-p", str(directory), "-c", str(config)]
    return start_process("nginx", argv, [base_url(port)], ready_path="/health")
