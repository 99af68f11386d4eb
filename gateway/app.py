"""The gateway as an aiohttp application: every generation request goes parse → rewrite → choose → forward →
record.

    exchange = await self.parse(request, endpoint)     # admitted, body read (bounded), JSON checked, model,
                                                        # session key
    exchange = self.rewrite(exchange)                   # volatile IDs moved off the prompt prefix (rewrite/)
    routing = self.router.routing_request(text, ...)    # chained block hashes of the prompt (hashing.py), under
                                                        # the model's seed, and the session key
    placement, upstream = await self.forward(...)       # router.place: healthy backends filtered, policy picks,
                                                        # load reserved; sent, and again if it failed before
                                                        # any answer byte (fleet/upstream.py says whose fault)
    return await self.relay_answer(...)                 # relayed as it arrives (api/relay.py), then `record`

The paths and how each is routed are the tables below: prompts routed by prefix (`GENERATION_PATHS`), the
rest of what engines serve to clients relayed to the least loaded backend (`ENGINE_PATHS`), and a stored
response's own routes sent to the backend that holds it (`STORED_RESPONSE_ROUTES`, gateway/api/responses.py).
Engine admin paths (/flush_cache, /start_profile, /update_weights*, ...) are in no table: 404 here.

A client that leaves cancels its handler at whatever step it is in, and every way a request ends releases its
placement and is recorded once. `create_app(config)` builds every part and hands it in; start-up runs the
first health checks, shutdown drains (see `on_shutdown`). Errors of any step are `GatewayError`s, turned into
OpenAI's error shape (Anthropic's on /v1/messages) in one middleware. The server hands the relayed paths to it
directly, past aiohttp's router (`skip_the_router_for_relays`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import hdrs, web
from aiohttp.typedefs import Middleware

from gateway.api.admin import AdminApi
from gateway.api.admission import Admission
from gateway.api.auth import ApiKeys
from gateway.api.drain import Drain
from gateway.api.headers import HeaderPolicy, client_request_id, forwarded_headers, with_backend_key
from gateway.api.prompts import Endpoint, dump_json, multipart_fields, read_json, routing_text, session_key
from gateway.api.relay import Ending, Outcome, Relay, error_for
from gateway.api.responses import ResponseOwners, StoredResponses
from gateway.config import GatewayConfig, check_url
from gateway.errors import (
    BadRequest,
    ErrorShape,
    GatewayError,
    PayloadTooLarge,
    ShuttingDown,
    http_error,
    unexpected_error,
)
from gateway.fleet.backends import Backend
from gateway.fleet.discovery import Discovery, Membership, sources
from gateway.fleet.health import Upkeep
from gateway.fleet.pool import Pool
from gateway.fleet.shared_state import shared_state
from gateway.fleet.upstream import UpstreamClient, UpstreamFailure, UpstreamResponse, log_ignored_proxy_environment
from gateway.observe.dashboard import Dashboard
from gateway.observe.logs import AccessLog, flush_every
from gateway.observe.metrics import GatewayMetrics
from gateway.rewrite import Rewriter, enabled_for
from gateway.routing.policies import RoutingRequest
from gateway.routing.router import Placement, Router

logger = logging.getLogger(__name__)

GENERATION_PATHS = {
    "/v1/chat/completions": Endpoint.CHAT,
    "/v1/completions": Endpoint.COMPLETION,
    "/generate": Endpoint.GENERATE,
    "/v1/embeddings": Endpoint.EMBEDDING,
    "/v1/responses": Endpoint.RESPONSES,
    "/v1/messages": Endpoint.MESSAGES,
}
# What else vLLM and SGLang serve to clients; it fills no prefix cache, so the least loaded backend gets it.
ENGINE_PATHS = {
    **dict.fromkeys(("/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize", "/v1/messages/count_tokens"),
                    Endpoint.TOKENIZE),
    **dict.fromkeys(("/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score"), Endpoint.SCORE),
    **dict.fromkeys(("/pooling", "/classify", "/v1/classify", "/encode"), Endpoint.POOLING),
    **dict.fromkeys(("/v1/audio/transcriptions", "/v1/audio/translations"), Endpoint.AUDIO),
    **dict.fromkeys(("/parse_function_call", "/separate_reasoning"), Endpoint.UTILITY),
}
RELAYED_PATHS = {**GENERATION_PATHS, **ENGINE_PATHS}
STORED_RESPONSE_ROUTES = (("GET", "/v1/responses/{response_id}"), ("DELETE", "/v1/responses/{response_id}"),
                          ("POST", "/v1/responses/{response_id}/cancel"),
                          ("GET", "/v1/responses/{response_id}/input_items"))
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# What a request carries for the record of one refused before it was placed (`record_rejection`).
STARTED_S = web.RequestKey("started_s", float)
REQUEST_ID = web.RequestKey("request_id", str)
MODEL = web.RequestKey("model", str)
PLACED = web.RequestKey("placed", bool)


@dataclass(slots=True)  # one per request, made and updated on the hot path: not frozen, which costs per field
class Exchange:
    endpoint: Endpoint
    method: str
    path: str
    body: dict[str, Any]
    raw: bytes
    model: str
    streaming: bool
    request_id: str
    started_s: float
    rewritten_spans: int = 0
    owner: Backend | None = None  # the one backend that can serve it: it holds the stored response named
    stored_id: str | None = None  # GET, DELETE or cancel of this stored response
    session: str | None = None  # the client's session key (prompts.session_key), when routing follows sessions


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.pool = Pool(config.backends, config.index_capacity_blocks(None),
                         retry_after_s=max(1, int(config.health.interval_s)), outlier=config.outlier)
        self.router = Router(self.pool, config.routing, config.default_model)
        self.rewriter = Rewriter(config.rewrite)
        self.metrics = GatewayMetrics(self.pool)
        self.pool.models_gone = self.metrics.forget_models  # an unloaded adapter's series go
        self.shared = shared_state(config.state, self.pool, self.metrics.registry, self.router.sessions)
        self.client = UpstreamClient(config.connect_timeout_s, config.first_byte_timeout_s, config.request_timeout_s)
        self.upkeep = Upkeep(self.pool, self.client, config)
        self.admission = Admission(config.max_concurrent_requests, config.max_queue_wait_s)
        self.keys = ApiKeys(config.api_keys, config.admin_api_keys)
        self.header_policy = HeaderPolicy(config.forward_client_credentials, config.trusted_proxies)
        self.stored = StoredResponses(ResponseOwners(config.responses_max_ids, config.responses_ttl_s), self.pool,
                                      self.client, config.health.timeout_s, config.expose_backend_urls)
        self.log_access = AccessLog()
        self.drain = Drain(config.shutdown_grace_s)
        self.log_flusher: asyncio.Task[None] | None = None
        # Backends at run time (fleet/discovery.py): a joined one is checked at once, a removed one's series go.
        self.membership = Membership(self.pool, self.upkeep.check_soon,
                                     lambda backend: self.metrics.forget_backend(backend.url))
        self.discovery = Discovery(self.membership, sources(config.backend_dns, config.backend_dns_interval_s,
                                                            config.backend_file))
        self.admin = AdminApi(self.membership, self.keys, check_url) if config.admin_port else None

    # -- the request path -------------------------------------------------------------------------------

    async def relay(self, request: web.Request) -> web.StreamResponse:
        return await self.drain.guard(self.admitted(request))

    async def admitted(self, request: web.Request) -> web.StreamResponse:
        await self.admission.enter()
        try:
            exchange = await self.parse(request, RELAYED_PATHS[request.path])
            exchange = self.rewrite(exchange, opted_out=not enabled_for(request.headers))
            routing = self.router.routing_request(routing_text(exchange.endpoint, exchange.body), exchange.model,
                                                  exchange.session)
            placement, upstream = await self.forward(exchange, routing, request)
            return await self.relay_answer(request, exchange, placement, upstream)
        finally:
            self.admission.leave()

    async def relay_stored(self, request: web.Request) -> web.StreamResponse:
        return await self.drain.guard(self.admitted_stored(request))

    async def admitted_stored(self, request: web.Request) -> web.StreamResponse:
        """GET, DELETE or cancel a stored response: at the backend that holds it (chosen in `parse_stored`)."""
        await self.admission.enter()
        try:
            exchange = await self.parse_stored(request)
            placement, upstream = await self.forward(exchange, self.router.routing_request(""), request)
            return await self.relay_answer(request, exchange, placement, upstream)
        finally:
            self.admission.leave()

    async def parse(self, request: web.Request, endpoint: Endpoint) -> Exchange:
        request_id_ = client_request_id(request.headers, os.urandom(16).hex())
        request[REQUEST_ID] = request_id_  # for the access line of a rejected request
        raw = await self.read_body(request)
        if endpoint.json_body:
            body = read_json(raw, endpoint)
        else:  # an upload: never decoded, only its small fields are looked up
            body = multipart_fields(raw, request.headers.get("content-type", ""))
        model = self.router.resolve_model(body.get("model"), body.get("lora_path"))
        request[MODEL] = model
        owner = await self.stored.owner_of(body.get("previous_response_id"), "previous_response_id", model) \
            if endpoint is Endpoint.RESPONSES else None
        session = session_key(endpoint, body, request.headers.get(self.config.session_header)) \
            if self.router.sessions is not None and endpoint.routes_by_prefix else None
        return Exchange(endpoint, request.method, request.path, body, raw, model, body.get("stream") is True,
                        request_id_, time.monotonic(), owner=owner, session=session)

    async def parse_stored(self, request: web.Request) -> Exchange:
        request_id_ = client_request_id(request.headers, os.urandom(16).hex())
        request[REQUEST_ID] = request_id_
        raw = await self.read_body(request)
        stored_id = request.match_info["response_id"]
        owner = await self.stored.owner_of(stored_id, None, None)
        model = owner.model if owner is not None and owner.model else self.router.resolve_model(None)
        request[MODEL] = model
        return Exchange(Endpoint.RESPONSES, request.method, request.path, {}, raw, model,
                        request.query.get("stream") == "true", request_id_, time.monotonic(), owner=owner,
                        stored_id=stored_id)

    async def read_body(self, request: web.Request) -> bytes:
        """The whole body, bounded in size (the app's client_max_size: 413 above it) and in time."""
        try:
            if request.content.is_eof():  # all of it arrived with the headers (most bodies): no timer needed
                return await request.read()
            async with asyncio.timeout(self.config.client_body_timeout_s):
                return await request.read()
        except TimeoutError:
            raise BadRequest(f"The request body did not arrive within {self.config.client_body_timeout_s:g} s.",
                             code="body_timeout") from None
        except web.HTTPRequestEntityTooLarge:
            raise PayloadTooLarge(f"The request body exceeds {self.config.max_body_bytes} bytes.") from None

    def rewrite(self, exchange: Exchange, opted_out: bool) -> Exchange:
        result = self.rewriter.rewrite(exchange.endpoint, exchange.body, exchange.model, opted_out=opted_out)
        for hit in result.hits:
            self.metrics.rewritten_spans.labels(hit.rule, hit.action.value).inc()
        if result.body is None:
            return exchange
        return replace(exchange, body=result.body, raw=dump_json(result.body, exchange.raw),
                       rewritten_spans=result.moved)

    async def forward(self, exchange: Exchange, routing: RoutingRequest, request: web.Request
                      ) -> tuple[Placement, UpstreamResponse]:
        """Place the request and open the exchange; one that fails before any answer byte is sent again, up to
        `max_retries` times, to another backend when there is one. Whatever way it fails, the placement is
        released and the outcome recorded."""
        # Before any placement: a header that cannot be forwarded is the client's 400, with nothing to release.
        headers = forwarded_headers(request.headers, exchange.request_id, request.remote, self.header_policy)
        tried: list[Placement] = []
        while True:
            placement = self.choose(exchange, routing, [p.backend for p in tried])
            request[PLACED] = True  # from here on, `finish` records however the request ends
            backend = placement.backend
            timeout_s = None if exchange.streaming else self.config.request_timeout_s
            try:
                upstream = await self.client.open(exchange.method, backend.url + request.path_qs, exchange.raw,
                                                  with_backend_key(headers, backend.spec.api_key), timeout_s)
            except UpstreamFailure as exc:
                if not self.retry_after(placement, exchange, exc, len(tried)):
                    raise error_for(exc) from exc
                tried.append(placement)
                continue
            except BaseException as exc:  # the client left or the shutdown grace ran out (cancelled), or a bug
                self.finish(placement, exchange, self.cancelled_outcome(exc))
                raise
            return placement, upstream

    def choose(self, exchange: Exchange, routing: RoutingRequest, avoid: list[Backend]) -> Placement:
        if exchange.owner is not None:
            return self.router.place_on(exchange.owner, routing)
        if exchange.endpoint.routes_by_prefix:
            return self.router.place(exchange.model, routing, avoid=avoid)
        return self.router.place_least_loaded(exchange.model, routing, avoid=avoid)

    def cancelled_outcome(self, exc: BaseException) -> Outcome:
        if not isinstance(exc, asyncio.CancelledError):
            return Outcome(status=500)
        if self.drain.cut_by_shutdown():
            return Outcome(status=ShuttingDown.status_code, ending=Ending.SHUTDOWN)
        return Outcome(status=499, ending=Ending.CLIENT_GONE)

    def retry_after(self, placement: Placement, exchange: Exchange, exc: UpstreamFailure, tries: int) -> bool:
        """Whether to send the request again after `exc`. A retried attempt counts as its backend's error, not
        as the request's outcome: the client sees only the retry's."""
        backend = placement.backend
        retry = exc.failure.retryable and tries < self.config.max_retries and exchange.owner is None \
            and bool(self.pool.serving(exchange.model))
        if not retry:  # `finish` reports the failure to the backend
            self.finish(placement, exchange, Outcome(status=error_for(exc).status_code, failure=exc.failure))
            return False
        if exc.failure.backend_fault:
            backend.exchange_failed(exc.failure, exc.detail)
        placement.finish()
        placement.unrecord()
        self.metrics.upstream_errors.labels(backend.url, exc.failure.value).inc()
        logger.warning("backend %s failed before answering (%s); sending request %s again", backend.url,
                       exc.detail, exchange.request_id)
        return True

    async def relay_answer(self, request: web.Request, exchange: Exchange, placement: Placement,
                           upstream: UpstreamResponse) -> web.StreamResponse:
        self.drain.answering()
        relay = Relay(request, upstream, self.response_headers(exchange, placement), exchange.streaming,
                      placement.placed_s, self.config.write_timeout_s)
        self.drain.open_relays.add(relay)
        try:
            return await relay.run(placement.first_byte)
        finally:
            self.drain.open_relays.discard(relay)
            self.record(placement, exchange, relay.outcome)
            if exchange.endpoint is Endpoint.RESPONSES and relay.outcome.status < 400:
                self.stored.answered(placement.backend, exchange.stored_id, exchange.method, relay.tap.payload())

    def response_headers(self, exchange: Exchange, placement: Placement) -> dict[str, str]:
        backend = placement.backend
        return {"x-request-id": exchange.request_id,
                "x-gateway-backend": backend.url if self.config.expose_backend_urls else backend.name,
                "x-gateway-route": placement.decision.route.value,
                "x-gateway-prefix-match": f"{placement.match_fraction:.3f}",
                "x-gateway-rewritten-spans": str(exchange.rewritten_spans)}

    # -- the record step --------------------------------------------------------------------------------

    def record(self, placement: Placement, exchange: Exchange, outcome: Outcome) -> None:
        self.finish(placement, exchange, outcome)
        if outcome.status >= 400:  # a rejected prompt is not cached there: it must not attract its successors
            placement.unrecord()
        if outcome.usage is not None and exchange.stored_id is None:  # a retrieved response was counted once
            self.record_usage(placement, exchange, outcome)

    def finish(self, placement: Placement, exchange: Exchange, outcome: Outcome) -> None:
        placement.finish()
        backend = placement.backend
        if outcome.failure is None and outcome.ending is None:
            backend.exchange_answered(outcome.status)
        elif outcome.failure is not None and outcome.failure.backend_fault:
            backend.exchange_failed(outcome.failure, outcome.failure.value)
        route, match = placement.decision.route.value, placement.match_fraction
        status, error = outcome.label, outcome.error
        now_s = time.monotonic()
        self.metrics.request_done(exchange.endpoint.value, exchange.model, backend.url, route, status,
                                  now_s - placement.placed_s, outcome.ttfb_s, match)
        if error and outcome.ending is not Ending.CLIENT_GONE:
            self.metrics.upstream_errors.labels(backend.url, error).inc()
        self.log_access(exchange.method, exchange.path, exchange.model, backend.url, route, match, status, error,
                        now_s - exchange.started_s, exchange.request_id)

    def record_usage(self, placement: Placement, exchange: Exchange, outcome: Outcome) -> None:
        usage = outcome.usage
        assert usage is not None
        prompt, cached, predicted = self.metrics.token_counters(exchange.model, placement.backend.url)
        prompt.inc(usage.prompt_tokens)
        if usage.cached_tokens is None:
            return
        cached.inc(usage.cached_tokens)
        predicted.inc(min(placement.predicted_cached_tokens, usage.prompt_tokens))
        found = placement.found_prefix(usage.cached_tokens)
        if found is not None:
            self.metrics.prefix_turn(exchange.model, placement.backend.url, found)
        if outcome.status < 400 and placement.learn(usage.cached_tokens):
            self.metrics.index_corrections.labels(placement.backend.url).inc()

    def record_rejection(self, request: web.Request, error: GatewayError) -> None:
        """A request refused before it was placed still gets its access line and its metric sample."""
        endpoint = endpoint_of(request)
        model = request.get(MODEL, "")
        self.metrics.request_done(endpoint.value if endpoint else "other", model, "", "", str(error.status_code),
                                  None, None, None)
        self.log_access(request.method, request.path, model, "", "", 0.0, str(error.status_code),
                        error.code or error.error_type, time.monotonic() - request[STARTED_S],
                        request.get(REQUEST_ID, ""))

    # -- read-only endpoints ----------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": self.pool.model_cards()})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        ready = self.pool.ready() and not self.drain.stopping
        missing = sorted(set(self.pool.models(healthy_only=False)) - set(self.pool.models()))
        return web.json_response({"ready": ready, "stopping": self.drain.stopping, "models": self.pool.models(),
                                  "models_without_backend": missing,
                                  "requests": {"in_flight": self.admission.in_flight,
                                               "waiting": self.admission.waiting},
                                  "state": self.shared.describe()},
                                 status=200 if ready else 503)

    async def backends(self, request: web.Request) -> web.Response:
        return web.json_response({"policy": self.router.policy.name,
                                  "backends": [backend.describe() for backend in self.pool.backends]})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            headers={"content-type": "text/plain; version=0.0.4; charset=utf-8"})

    # -- start and stop ---------------------------------------------------------------------------------

    async def on_startup(self, app: web.Application) -> None:
        self.log_flusher = asyncio.create_task(flush_every())
        log_ignored_proxy_environment(os.environ)
        await self.client.start()
        await self.discovery.start()  # the discovered backends are in the first round of health checks
        await self.upkeep.start()
        await self.shared.start()  # replays the other instances' placements before serving
        self.membership.start()
        if self.admin is not None and self.config.admin_port is not None:
            await self.admin.start(self.config.admin_host, self.config.admin_port)

    async def on_shutdown(self, app: web.Application) -> None:
        """The server has stopped accepting: /ready says so at once, and what is in flight drains."""
        await self.drain.drain()

    async def on_cleanup(self, app: web.Application) -> None:
        if self.admin is not None:
            await self.admin.stop()
        await self.discovery.stop()
        await self.membership.stop()
        await self.shared.stop()
        await self.upkeep.stop()
        await self.client.close()
        if self.log_flusher is not None:
            self.log_flusher.cancel()
            await asyncio.gather(self.log_flusher, return_exceptions=True)


def endpoint_of(request: web.Request) -> Endpoint | None:
    """The relayed endpoint a request is for, None for the gateway's own routes and unknown paths."""
    if request.path in RELAYED_PATHS:
        return RELAYED_PATHS[request.path]
    return Endpoint.RESPONSES if "response_id" in request.match_info else None


def error_middleware(gateway: Gateway) -> Middleware:
    """Authentication, then any error in OpenAI's shape (Anthropic's on its API): ours, the server's own (404,
    405, 413), or a bug."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        request[STARTED_S] = time.monotonic()
        try:
            if gateway.keys.enabled:
                gateway.keys.check(request.path, request.headers)
            return await handler(request)
        except GatewayError as exc:
            return error_response(gateway, request, exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(gateway, request, http_error(request.method, request.path, exc))
        except RecursionError:  # JSON nested near the parser's limit, walked again by a later step
            return error_response(gateway, request, BadRequest("The request body is nested too deeply."))
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            return error_response(gateway, request, unexpected_error(request.method, request.path))

    return middleware


def error_response(gateway: Gateway, request: web.Request, error: GatewayError) -> web.Response:
    if error.status_code >= 500:
        logger.warning("%s %s -> %d: %s", request.method, request.path, error.status_code, error.message)
    if endpoint_of(request) is not None and not request.get(PLACED):
        gateway.record_rejection(request, error)
    return web.json_response(error.body(ErrorShape.for_path(request.path)), status=error.status_code,
                             headers=error.headers())


# aiohttp 3.14 warns about plain string keys, once per call site (and the tests turn warnings into errors).
GATEWAY = web.AppKey("gateway", Gateway)


def create_app(config: GatewayConfig) -> web.Application:
    gateway = Gateway(config)
    app = web.Application(middlewares=[error_middleware(gateway)], client_max_size=config.max_body_bytes)
    for path in RELAYED_PATHS:
        app.router.add_post(path, gateway.relay)
    for method, path in STORED_RESPONSE_ROUTES:
        app.router.add_route(method, path, gateway.relay_stored)
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_get("/health", gateway.health)
    app.router.add_get("/ready", gateway.ready)
    app.router.add_get("/backends", gateway.backends)
    app.router.add_get("/metrics", gateway.prometheus)
    app.add_routes(Dashboard(gateway.pool, gateway.metrics, gateway.router.policy.name).routes())
    app.on_startup.append(gateway.on_startup)
    app.on_shutdown.append(gateway.on_shutdown)
    app.on_cleanup.append(gateway.on_cleanup)
    app[GATEWAY] = gateway
    return app


def skip_the_router_for_relays(runner: web.AppRunner) -> None:
    """Hand a POST to a relayed path straight to the gateway: the same `error_middleware`, then `Gateway.relay`,
    past aiohttp's router and its middleware chain, which cost a relayed request ~2% of its CPU for nothing it
    needs (README, "Overhead"). Everything else goes through the application, and so does a request that
    expects 100-continue (its router answers that). Call after `runner.setup()`, before the first connection."""
    server = runner.server
    assert server is not None
    gateway, through_app = runner.app[GATEWAY], server.request_handler
    middleware = error_middleware(gateway)

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        if request.method == "POST" and request.path in RELAYED_PATHS and hdrs.EXPECT not in request.headers:
            return await middleware(request, gateway.relay)  # type: ignore[arg-type]  # a web.Request, from the app
        return await through_app(request)

    server.request_handler = handle
