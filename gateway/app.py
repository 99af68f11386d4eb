"""The gateway as an ASGI app: every generation request goes parse → rewrite → choose → forward → record.

    exchange = await parse(request, endpoint)        # body read (bounded), JSON checked, model resolved
    exchange = rewrite(exchange)                     # volatile IDs moved off the prompt prefix (rewrite.py)
    routing = router.routing_request(text)           # chained block hashes of the prompt (hashing.py)
    placement, upstream = await forward(...)         # router.place: healthy backends filtered, policy picks,
                                                     # load reserved; then sent as-is, again if it failed
                                                     # before any answer byte
    return RelayResponse(upstream, on_done=record)   # relayed chunk by chunk; usage read at the end

A client that leaves stops the exchange at any point, and every way a request ends releases its placement.

`create_app(config)` builds every part and hands it in; the lifespan starts the health checks and closes the
shared HTTP client. Errors of any step are `GatewayError`s, turned into OpenAI's error shape in one handler.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import httpx2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.backends import Backend, Pool
from gateway.config import GatewayConfig
from gateway.errors import BadRequest, GatewayError, PayloadTooLarge, UpstreamTimeout
from gateway.health import Upkeep
from gateway.metrics import GatewayMetrics
from gateway.policies import RoutingRequest
from gateway.prompts import Endpoint, routing_text, validate_body
from gateway.rewrite import Rewriter, enabled_for
from gateway.router import Placement, Router
from gateway.shared_state import shared_state
from gateway.upstream import (Outcome, RelayResponse, broken, create_client, forwarded_headers, is_retryable,
                              log_ignored_proxy_environment, send_upstream, unless_client_leaves)
from gateway.usage import Usage

logger = logging.getLogger(__name__)
access_log = logging.getLogger("gateway.access")

GENERATION_PATHS = {
    "/v1/chat/completions": Endpoint.CHAT,
    "/v1/completions": Endpoint.COMPLETION,
    "/generate": Endpoint.GENERATE,
    "/v1/embeddings": Endpoint.EMBEDDING,
}


@dataclass(frozen=True)
class Exchange:
    endpoint: Endpoint
    path: str
    body: dict[str, Any]
    raw: bytes
    model: str
    streaming: bool
    request_id: str
    started_s: float
    rewritten_spans: int = 0


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.pool = Pool(config.backends, config.index_capacity_blocks(None),
                         retry_after_s=max(1, int(config.health.interval_s)))
        self.router = Router(self.pool, config.routing, config.default_model)
        self.rewriter = Rewriter(config.rewrite)
        self.metrics = GatewayMetrics(self.pool)
        self.shared = shared_state(config.state, self.pool, self.metrics.registry)
        self.client = create_client(config.connect_timeout_s, config.request_timeout_s)
        self.upkeep = Upkeep(self.pool, self.client, config)

    # -- the request path -------------------------------------------------------------------------------

    async def relay(self, request: Request) -> Response | RelayResponse:
        exchange = await self.parse(request, GENERATION_PATHS[request.url.path])
        exchange = self.rewrite(exchange, opted_out=not enabled_for(request.headers))
        routing = self.router.routing_request(routing_text(exchange.endpoint, exchange.body))
        headers = forwarded_headers(request.headers.raw, exchange.request_id)
        opened = await unless_client_leaves(request.receive, self.forward(exchange, routing, headers),
                                            lambda late: self.abandon(exchange, *late))
        if opened is None:
            return Response(status_code=499)  # nobody is listening; the record step has counted it
        placement, upstream = opened
        return RelayResponse(upstream, self.response_headers(exchange, placement), exchange.streaming,
                             placement.first_byte, lambda outcome: self.record(placement, exchange, outcome),
                             placement.placed_s)

    async def parse(self, request: Request, endpoint: Endpoint) -> Exchange:
        raw = await self.read_body(request)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"The request body is not valid JSON: {exc}.") from None
        problem = validate_body(endpoint, body)
        if problem:
            raise BadRequest(problem)
        return Exchange(endpoint, request.url.path, body, raw, self.router.resolve_model(body.get("model")),
                        body.get("stream") is True, request.headers.get("x-request-id") or uuid.uuid4().hex,
                        time.monotonic())

    async def read_body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.config.max_body_bytes:
            raise PayloadTooLarge(f"The request body exceeds {self.config.max_body_bytes} bytes.")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.config.max_body_bytes:
                raise PayloadTooLarge(f"The request body exceeds {self.config.max_body_bytes} bytes.")
            chunks.append(chunk)
        return b"".join(chunks)

    def rewrite(self, exchange: Exchange, opted_out: bool) -> Exchange:
        result = self.rewriter.rewrite(exchange.endpoint, exchange.body, exchange.model, opted_out=opted_out)
        for hit in result.hits:
            self.metrics.rewritten_spans.labels(hit.rule, hit.action.value).inc()
        if result.body is None:
            return exchange
        raw = json.dumps(result.body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        return replace(exchange, body=result.body, raw=raw, rewritten_spans=result.moved)

    async def forward(self, exchange: Exchange, routing: RoutingRequest, headers: list[tuple[bytes, bytes]]
                      ) -> tuple[Placement, httpx2.Response]:
        """Place the request and open the exchange; one that fails before any answer byte is sent again, up to
        `max_retries` times. Whatever way it fails, the placement is released and the outcome recorded."""
        failed: list[Backend] = []
        while True:
            placement = self.router.place(exchange.model, routing, avoid=failed)
            try:
                return placement, await send_upstream(self.client, placement.backend.url + exchange.path,
                                                      exchange.raw, headers)
            except httpx2.TransportError as exc:
                if not self.attempt_failed(placement, exchange, exc, len(failed)):
                    raise broken(exc) from exc
                failed.append(placement.backend)
            except UpstreamTimeout:
                self.finish(placement, exchange, Outcome(status=504, error="timeout"))
                raise
            except BaseException as exc:  # the client left (we were cancelled), or a bug
                gone = isinstance(exc, asyncio.CancelledError)
                self.finish(placement, exchange, Outcome(status=499 if gone else 500,
                                                         error="client_disconnect" if gone else "internal"))
                raise

    def attempt_failed(self, placement: Placement, exchange: Exchange, exc: httpx2.TransportError,
                       failures_before: int) -> bool:
        """Whether to send the request again. A retried attempt counts as its backend's error, not as the
        request's outcome: the client sees only the retry's."""
        backend = placement.backend
        if isinstance(exc, httpx2.ConnectError):
            backend.mark_down(f"connection failed: {exc}")
        if not (failures_before < self.config.max_retries and is_retryable(exc) and self.pool.serving(exchange.model)):
            self.finish(placement, exchange, Outcome(status=502, error="unreachable"))
            return False
        placement.finish()
        placement.unrecord()
        self.metrics.upstream_errors.labels(backend.url, "unreachable").inc()
        logger.warning("backend %s failed before answering (%s); sending request %s again", backend.url,
                       exc.__class__.__name__, exchange.request_id)
        return True

    async def abandon(self, exchange: Exchange, placement: Placement, upstream: httpx2.Response) -> None:
        """The gateway is stopping, and an exchange opened just then will not be relayed."""
        await upstream.aclose()
        self.finish(placement, exchange, Outcome(status=499, error="client_disconnect"))

    def response_headers(self, exchange: Exchange, placement: Placement) -> dict[str, str]:
        return {"x-request-id": exchange.request_id, "x-gateway-backend": placement.backend.url,
                "x-gateway-route": placement.decision.route.value,
                "x-gateway-prefix-match": f"{placement.match_fraction:.3f}",
                "x-gateway-rewritten-spans": str(exchange.rewritten_spans)}

    # -- the record step --------------------------------------------------------------------------------

    async def record(self, placement: Placement, exchange: Exchange, outcome: Outcome) -> None:
        self.finish(placement, exchange, outcome)
        if outcome.usage is not None:
            self.record_usage(placement, exchange, outcome.usage)

    def finish(self, placement: Placement, exchange: Exchange, outcome: Outcome) -> None:
        placement.finish()
        backend, endpoint = placement.backend.url, exchange.endpoint.value
        status = "499" if outcome.error == "client_disconnect" else str(outcome.status)
        route = placement.decision.route.value
        now_s = time.monotonic()
        duration_s = now_s - exchange.started_s
        self.metrics.requests.labels(endpoint, exchange.model, backend, route, status).inc()
        self.metrics.upstream_latency.labels(endpoint, backend).observe(now_s - placement.placed_s)
        if outcome.ttfb_s is not None:
            self.metrics.upstream_ttfb.labels(endpoint, backend).observe(outcome.ttfb_s)
        self.metrics.prefix_match.labels(exchange.model, route).observe(placement.match_fraction)
        if outcome.error and outcome.error != "client_disconnect":
            self.metrics.upstream_errors.labels(backend, outcome.error).inc()
        access_log.info("%s %s model=%s backend=%s route=%s match=%.3f status=%s%s duration_ms=%.1f id=%s",
                        "POST", exchange.path, exchange.model, backend, route, placement.match_fraction, status,
                        f" error={outcome.error}" if outcome.error else "", duration_s * 1000,
                        exchange.request_id)

    def record_usage(self, placement: Placement, exchange: Exchange, usage: Usage) -> None:
        labels = (exchange.model, placement.backend.url)
        self.metrics.prompt_tokens.labels(*labels).inc(usage.prompt_tokens)
        if usage.cached_tokens is None:
            return
        predicted = min(placement.predicted_cached_tokens, usage.prompt_tokens)
        self.metrics.cached_tokens.labels(*labels).inc(usage.cached_tokens)
        self.metrics.predicted_cached_tokens.labels(*labels).inc(predicted)
        if placement.learn(usage.cached_tokens):
            self.metrics.index_corrections.labels(placement.backend.url).inc()

    # -- read-only endpoints ----------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": self.pool.model_cards()})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        ready = self.pool.ready()
        missing = sorted(set(self.pool.models(healthy_only=False)) - set(self.pool.models()))
        return JSONResponse({"ready": ready, "models": self.pool.models(), "models_without_backend": missing,
                             "state": self.shared.describe()}, status_code=200 if ready else 503)

    async def backends(self, request: Request) -> Response:
        return JSONResponse({"policy": self.router.policy.name,
                             "backends": [backend.describe() for backend in self.pool.backends]})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        log_ignored_proxy_environment(os.environ)
        await self.upkeep.start()
        await self.shared.start()  # replays the other instances' placements before serving
        logger.info("gateway ready: policy %s, %d backends, models %s", self.router.policy.name,
                    len(self.pool.backends), ", ".join(self.pool.models()) or "none yet")
        try:
            yield
        finally:
            await self.shared.stop()
            await self.upkeep.stop()
            await self.client.aclose()


async def gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    if exc.status_code >= 500:
        logger.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status_code, exc.message)
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers())


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405, in OpenAI's error shape like every other gateway error."""
    assert isinstance(exc, HTTPException)
    error = BadRequest(f"{request.method} {request.url.path}: {exc.detail}", code=str(exc.status_code))
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


async def internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(GatewayError("The gateway failed unexpectedly; see its log.").body(), status_code=500)


def create_app(config: GatewayConfig) -> Starlette:
    gateway = Gateway(config)
    routes = [Route(path, gateway.relay, methods=["POST"]) for path in GENERATION_PATHS]
    routes += [
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/ready", gateway.ready, methods=["GET"]),
        Route("/backends", gateway.backends, methods=["GET"]),
        Route("/metrics", gateway.prometheus, methods=["GET"]),
    ]
    handlers = {GatewayError: gateway_error, HTTPException: http_error, Exception: internal_error}
    app = Starlette(routes=routes, lifespan=gateway.lifespan, exception_handlers=handlers)
    app.state.gateway = gateway
    return app
