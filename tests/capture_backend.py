"""A backend that records what reaches it, served by a real uvicorn on loopback in a background thread.

For tests that must see the exact bytes and headers the gateway forwards (the simulated replica does not
echo them).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from simulator.fleet import base_url, free_port


@dataclass
class Captured:
    bodies: list[bytes] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # with the query string


def capture_app(model: str, captured: Captured) -> Starlette:
    async def chat(request: Request) -> Response:
        captured.bodies.append(await request.body())
        captured.headers.append(dict(request.headers))
        captured.paths.append(request.url.path + (f"?{request.url.query}" if request.url.query else ""))
        if json.loads(captured.bodies[-1]).get("reject"):
            return JSONResponse({"error": {"message": "context too long", "type": "invalid_request_error",
                                           "param": None, "code": "context_length_exceeded"}}, status_code=400)
        return JSONResponse({"id": "x", "object": "chat.completion", "created": 0, "model": model,
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                          "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}},
                            headers={"x-upstream-marker": "kept", "connection": "keep-alive"})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "test"}]})

    async def health(request: Request) -> Response:
        return Response("")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health)])


@contextmanager
def capture_backend(model: str = "capture-model") -> Iterator[tuple[str, Captured]]:
    captured = Captured()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(capture_app(model, captured), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield base_url(port), captured
    finally:
        server.should_exit = True
        thread.join(timeout=10)
