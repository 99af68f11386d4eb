"""The *forward* step: send the request to the chosen backend and relay its answer as it arrives.

One shared httpx2 client with a connection pool serves every upstream call (requests, health checks, metadata).
It is built with `trust_env=False`: the host's HTTP_PROXY/HTTPS_PROXY/ALL_PROXY must never be applied to calls
to our own replicas (seed 000: a set proxy variable turned every engine call into a 502; sglang-router still
breaks this way).

Why httpx2 and not httpx 0.x: httpx's pool (httpcore 1.0) rescans every pooled connection once per idle
connection each time a request starts or ends, so its cost grows with the square of the pool. At hot-tenant
overload (a few hundred streams) that was 46% of the gateway's CPU, and the event loop's lag raised p99 TTFT
from 0.09 s to 0.7-0.8 s. httpx2's pool is linear; the API is the same.

httpx2's exceptions are translated here, at this one boundary, into the gateway's own (`errors.py`). A request
that failed before any answer byte is sent again, to another backend if there is one (a refused connection marks
its backend down); the same backend takes it when it is the only one left, since such a failure is mostly a
pooled keep-alive connection the engine had closed (llama.cpp does after streams). A timeout is not retried
(the backend may still be working on it) and becomes 504.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import httpx2
from starlette.types import Receive, Scope, Send

from gateway.errors import UpstreamError, UpstreamTimeout
from gateway.usage import Usage, UsageTap

logger = logging.getLogger(__name__)
T = TypeVar("T")

PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "trailers", "transfer-encoding", "upgrade"})
# accept-encoding: ask backends for identity bodies, so the usage tap reads plain JSON.
_NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "accept-encoding"}
# date/server: uvicorn writes its own.
_NOT_RELAYED = HOP_BY_HOP | {"date", "server"}


def create_client(connect_timeout_s: float, request_timeout_s: float) -> httpx2.AsyncClient:
    timeout = httpx2.Timeout(request_timeout_s, connect=connect_timeout_s, pool=request_timeout_s)
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=512, keepalive_expiry=60.0)
    return httpx2.AsyncClient(trust_env=False, timeout=timeout, limits=limits)


def log_ignored_proxy_environment(environ: Mapping[str, str]) -> None:
    found = sorted(name for name in environ if name.upper() in PROXY_VARIABLES)
    if found:
        logger.info("proxy variables %s are set and ignored: upstream calls go directly to the backends",
                    ", ".join(found))


def forwarded_headers(raw: Sequence[tuple[bytes, bytes]], request_id: str) -> list[tuple[bytes, bytes]]:
    """The client's headers as the bytes it sent (a UTF-8 value must pass, not fail to re-encode), less the
    hop-by-hop ones, with our request id."""
    kept = [(name, value) for name, value in raw if name.lower().decode("latin-1") not in _NOT_FORWARDED
            and name.lower() != b"x-request-id"]
    return [*kept, (b"x-request-id", request_id.encode("latin-1"))]


def relayed_headers(headers: httpx2.Headers) -> list[tuple[bytes, bytes]]:
    return [(name.lower(), value) for name, value in headers.raw
            if name.lower().decode("latin-1") not in _NOT_RELAYED]


@dataclass
class Outcome:
    """How a relayed exchange ended, for the record step."""

    status: int
    usage: Usage | None = None
    error: str | None = None  # "timeout", "broken", "client_disconnect", or None
    ttfb_s: float | None = None


async def send_upstream(client: httpx2.AsyncClient, url: str, body: bytes,
                        headers: Sequence[tuple[bytes, bytes]]) -> httpx2.Response:
    """Open the exchange; raises UpstreamTimeout, or httpx2.TransportError when it may be retried elsewhere."""
    request = client.build_request("POST", url, content=body, headers=list(headers))
    try:
        return await client.send(request, stream=True)
    except httpx2.TimeoutException as exc:
        if isinstance(exc, (httpx2.ConnectTimeout, httpx2.PoolTimeout)):
            raise  # nothing reached the backend: safe to try another
        raise UpstreamTimeout(f"The backend did not answer within the request timeout ({exc.__class__.__name__}).",
                              code="upstream_timeout") from exc


async def unless_client_leaves(receive: Receive, opening: Coroutine[Any, Any, T],
                               abandon: Callable[[T], Awaitable[None]]) -> T | None:
    """Await `opening`, or cancel it and return None as soon as the client disconnects.

    SGLang and vLLM send a non-streamed answer's headers only when it is complete. A client that gives up
    before then (SDKs time out, then retry) must not leave the engine generating for nobody: cancelling closes
    our upstream connection, and the engine aborts the request when it sees that. When we are cancelled
    ourselves (the server stops) just as `opening` finished, what it opened goes to `abandon`."""
    opened = asyncio.ensure_future(opening)
    left = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((opened, left), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        left.cancel()
        opened.cancel()
        [result] = await asyncio.gather(opened, return_exceptions=True)
        if not isinstance(result, BaseException):
            await abandon(result)
        raise
    left.cancel()
    if not opened.done():  # the client left first
        opened.cancel()
        await asyncio.gather(opened, return_exceptions=True)  # it releases what it holds as it is cancelled
        return None
    return opened.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def is_retryable(exc: httpx2.TransportError) -> bool:
    """Errors raised before any response byte arrived; the request can be sent again."""
    return isinstance(exc, (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout, httpx2.RemoteProtocolError,
                            httpx2.ReadError, httpx2.WriteError))


def broken(exc: httpx2.TransportError) -> UpstreamError:
    return UpstreamError(f"The backend broke the connection: {exc.__class__.__name__}.", code="upstream_broken")


class RelayResponse:
    """An ASGI response that relays an upstream response chunk by chunk, never buffering it.

    It watches the client too: when the client goes away the upstream request is closed at once (the engine
    then aborts it), and `on_done` runs exactly once however the exchange ends.
    """

    def __init__(self, upstream: httpx2.Response, extra_headers: Mapping[str, str], streaming: bool,
                 on_first_byte: Callable[[], None], on_done: Callable[[Outcome], Awaitable[None]],
                 started_s: float) -> None:
        self.upstream = upstream
        self.headers = relayed_headers(upstream.headers) + [
            (name.encode("latin-1"), value.encode("latin-1")) for name, value in extra_headers.items()]
        self.tap = UsageTap(streaming)
        self.streaming = streaming
        self.on_first_byte = on_first_byte
        self.on_done = on_done
        self.started_s = started_s
        self.outcome = Outcome(status=upstream.status_code)
        self.upstream_finished = False  # past this, a disconnect is the server closing a finished exchange

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.upstream.status_code, "headers": self.headers})
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._cancel_on_disconnect, receive, tasks.cancel_scope)
                await self._relay_body(send)
                tasks.cancel_scope.cancel()
        except OSError:  # the client's socket went away under uvicorn's send
            self.outcome.error = "client_disconnect"
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()
                self.outcome.usage = self.tap.usage()
                await self.on_done(self.outcome)

    async def _relay_body(self, send: Send) -> None:
        try:
            async for chunk in self.upstream.aiter_raw():
                if self.outcome.ttfb_s is None:
                    self.outcome.ttfb_s = time.monotonic() - self.started_s
                    if self.upstream.is_success:  # an error answer prefilled nothing: it must not teach a rate
                        self.on_first_byte()
                self.tap.feed(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self.upstream_finished = True
        except httpx2.TimeoutException:
            self.outcome.error = "timeout"
            await self._send_stream_error(UpstreamTimeout("The backend stopped sending within the request "
                                                          "timeout.", code="upstream_timeout"), send)
        except httpx2.TransportError as exc:
            self.outcome.error = "broken"
            await self._send_stream_error(broken(exc), send)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send_stream_error(self, error: UpstreamError | UpstreamTimeout, send: Send) -> None:
        """Headers are gone already; tell a streaming client in-band, as an SSE error event it can parse."""
        logger.warning("backend %s broke a response mid-way: %s", self.upstream.request.url, error.message)
        if self.streaming:
            event = b"data: " + json.dumps(error.body()).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": True})

    async def _cancel_on_disconnect(self, receive: Receive, scope: anyio.CancelScope) -> None:
        await _disconnected(receive)
        if not self.upstream_finished:
            self.outcome.error = self.outcome.error or "client_disconnect"
        scope.cancel()
