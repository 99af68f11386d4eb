"""The gateway app in-process, in front of fake backends in the same event loop, all on loopback.

The fake backends are real aiohttp servers, so the gateway's real upstream client meets real sockets: a
refused connection, a connection closed before the status line, a stream cut mid-way are what the kernel makes
of them, not simulations of aiohttp's exceptions. Each fake answers `/health` and `/v1/models`, and its
generation endpoints run the next `Behaviour` of its script (then its default one). It counts the requests it
received and those whose client (the gateway) went away while it was answering.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from multidict import CIMultiDictProxy

from gateway.app import GATEWAY, GENERATION_PATHS, Gateway, create_app, skip_the_router_for_relays
from gateway.config import GatewayConfig, HealthConfig
from gateway.fleet.backends import BackendSpec
from simulator.fleet import base_url, free_port

MODEL = "fake-model"
Behaviour = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def answer_json(request: web.Request) -> web.StreamResponse:
    return web.json_response({"id": "x", "object": "chat.completion", "model": MODEL,
                              "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                           "finish_reason": "stop"}],
                              "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def chunk(text: str) -> bytes:
    return sse({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]})


async def answer_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for text in ("one", "two", "three"):
        await response.write(chunk(text))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def answer_status(status: int, code: str) -> Behaviour:
    async def behaviour(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": f"backend says {code}", "type": "invalid_request_error",
                                            "param": None, "code": code}}, status=status,
                                 headers={"x-backend-marker": "kept"})
    return behaviour


async def close_before_answer(request: web.Request) -> web.StreamResponse:
    assert request.transport is not None
    request.transport.abort()
    await asyncio.sleep(10)  # cancelled when the server sees the connection gone
    raise AssertionError("unreachable")


def stream_then_cut(chunks: int) -> Behaviour:
    async def behaviour(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for index in range(chunks):
            await response.write(chunk(f"part {index}"))
        await asyncio.sleep(0.05)  # let the chunks leave before the connection is cut
        assert request.transport is not None
        request.transport.abort()
        return response
    return behaviour


def silent(seconds: float) -> Behaviour:
    async def behaviour(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(seconds)
        return await answer_json(request)
    return behaviour


def stream_forever(period_s: float = 0.02, payload_bytes: int = 16) -> Behaviour:
    """A stream that never ends: one chunk every `period_s`."""
    async def behaviour(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        while True:
            await response.write(chunk("x" * payload_bytes))
            await asyncio.sleep(period_s)
    return behaviour


@dataclass
class FakeBackend:
    default: Behaviour = answer_json
    script: list[Behaviour] = field(default_factory=list)  # run first, one per request
    received: list[web.Request] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    abandoned: int = 0  # requests whose connection closed while this backend was answering
    server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.received.append(request)
        self.bodies.append(await request.read())
        behaviour = self.script.pop(0) if self.script else self.default
        try:
            return await behaviour(request)
        except asyncio.CancelledError:
            self.abandoned += 1
            raise

    def app(self) -> web.Application:
        app = web.Application()
        for path in GENERATION_PATHS:
            app.router.add_post(path, self.generate)

        async def health(request: web.Request) -> web.Response:
            return web.Response(text="OK")

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        return app


# Health checks and scrapes stay out of the way: a test marks backends up or down itself.
QUIET = GatewayConfig(health=HealthConfig(interval_s=3600.0), metrics_interval_s=0.0, log_level="warning")


@dataclass
class Harness:
    client: TestClient[web.Request, web.Application]
    gateway: Gateway
    backends: list[FakeBackend]

    async def chat(self, content: str = "hello", *, headers: dict[str, str] | None = None,
                   **extra: Any) -> tuple[int, dict[str, Any], CIMultiDictProxy[str]]:
        """POST a chat request and read the whole answer: status, JSON body (or {"raw": text}), headers."""
        body = {"messages": [{"role": "user", "content": content}], **extra}
        async with self.client.post("/v1/chat/completions", json=body, headers=headers) as response:
            text = await response.text()
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = {"raw": text}
            return response.status, parsed, response.headers

    def assert_nothing_held(self) -> None:
        """Every placement released and every admission slot given back."""
        backends = self.gateway.pool.backends
        assert [backend.in_flight for backend in backends] == [0] * len(backends)
        assert [backend.pending_prefill_tokens for backend in backends] == [0] * len(backends)
        assert self.gateway.admission.in_flight == 0 and self.gateway.admission.waiting == 0

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for line in self.gateway.metrics.render().decode().splitlines():
            if line.startswith(name + "{") and all(f'{key}="{value}"' in line for key, value in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


@asynccontextmanager
async def running_gateway(*backends: FakeBackend, dead: int = 0, silent_urls: Sequence[str] = (),
                          **options: Any) -> AsyncIterator[Harness]:
    """The gateway in front of `backends`, of `dead` backends that refuse connections and of backends at
    `silent_urls` that do not accept them (all marked healthy, so the gateway finds out by trying), with `options`
    overriding `QUIET`'s fields."""
    for backend in backends:
        backend.server = TestServer(backend.app())
        await backend.server.start_server()
    urls = [backend.url for backend in backends] + [base_url(free_port()) for _ in range(dead)] + list(silent_urls)
    specs = tuple(BackendSpec(url, MODEL, name=f"backend-{index + 1}") for index, url in enumerate(urls))
    app = create_app(replace(QUIET, backends=specs, **options))
    client = TestClient(TestServer(app))
    await client.start_server()
    assert client.server.runner is not None
    skip_the_router_for_relays(client.server.runner)  # as the gateway serves
    gateway = app[GATEWAY]
    for placed in gateway.pool.backends:
        placed.health_check_passed(success_threshold=1)
    try:
        yield Harness(client, gateway, list(backends))
    finally:
        await client.close()
        for backend in backends:
            assert backend.server is not None
            await backend.server.close()
