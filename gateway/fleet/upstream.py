"""The gateway's one HTTP client, and the one place its exceptions become the gateway's own outcomes.

One aiohttp session with a connection pool serves every upstream call (requests, health checks, discovery,
metrics); relayed requests use its pool without its `request()` (see `open`). aiohttp replaced httpx2 here
because it measured 3-4x cheaper per request on the relay path (README, "Overhead"). Neither path reads the
host's proxy environment (`trust_env=False`, aiohttp's default): HTTP_PROXY/HTTPS_PROXY/ALL_PROXY must never
apply to calls to our own replicas (seed 000: a set proxy variable turned every engine call into a 502;
sglang-router still breaks this way). No headers of aiohttp's own are added either: the engine sees what the
client asked for (an `Accept-Encoding` the client did not send would get it a body it cannot read).

Everything aiohttp raises is translated here into an `UpstreamFailure` with a `Failure` kind, so the rest of the
gateway reasons about our outcomes only: whose fault it was (the backend's or our own), and whether anything
reached the engine (then the request may be sent again).
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from enum import Enum
from typing import Any

import aiohttp
from aiohttp import hdrs
from aiohttp.connector import Connection
from aiohttp.http_writer import StreamWriter
from aiohttp.http_writer import _serialize_headers as serialize_headers  # aiohttp's own, C, with its checks
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

logger = logging.getLogger(__name__)

PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")
# aiohttp would add these; a relay must not.
_NO_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
_READ_BUFFER_BYTES = 2**16  # a session's default
# Errors of our own process, not of the backend: they must never count against it.
_LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL})


class Failure(str, Enum):
    """How an exchange with a backend failed."""

    CONNECT = "connect"                  # refused, unreachable or timed out connecting: nothing was sent
    BROKEN_BEFORE_ANSWER = "broken_before_answer"  # sent, but the connection broke before the status line
    FIRST_BYTE_TIMEOUT = "first_byte_timeout"      # no answer within the first-byte timeout
    BROKEN = "broken"                    # the answer broke off mid-body
    IDLE_TIMEOUT = "idle_timeout"        # the answer stalled between chunks
    LOCAL = "local"                      # the gateway's own resources ran out (file descriptors, memory)

    @property
    def retryable(self) -> bool:
        """Nothing reached the engine's generation, so the request may be sent again."""
        return self in (Failure.CONNECT, Failure.BROKEN_BEFORE_ANSWER)

    @property
    def backend_fault(self) -> bool:
        return self is not Failure.LOCAL

    @property
    def timed_out(self) -> bool:
        return self in (Failure.FIRST_BYTE_TIMEOUT, Failure.IDLE_TIMEOUT)


class UpstreamFailure(Exception):
    def __init__(self, failure: Failure, detail: str) -> None:
        super().__init__(f"{failure.value}: {detail}")
        self.failure = failure
        self.detail = detail


def _translate(exc: BaseException, answered: bool) -> UpstreamFailure:
    """aiohttp's (and the socket layer's) exception as our outcome; `answered`: the status line had arrived."""
    name = exc.__class__.__name__
    if isinstance(exc, aiohttp.ClientConnectorError):
        local = exc.os_error.errno in _LOCAL_ERRNOS
        return UpstreamFailure(Failure.LOCAL if local else Failure.CONNECT, f"{name}: {exc.os_error}")
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return UpstreamFailure(Failure.CONNECT, name)
    if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return UpstreamFailure(Failure.IDLE_TIMEOUT if answered else Failure.FIRST_BYTE_TIMEOUT, name)
    if isinstance(exc, OSError) and exc.errno in _LOCAL_ERRNOS:
        return UpstreamFailure(Failure.LOCAL, f"{name}: {exc}")
    return UpstreamFailure(Failure.BROKEN if answered else Failure.BROKEN_BEFORE_ANSWER, name)


# What the translation covers: every aiohttp client error, socket errors, and timeouts.
_TRANSLATED = (aiohttp.ClientError, OSError, asyncio.TimeoutError)


class UpstreamResponse:
    """An opened exchange: status and headers arrived, the body is read with `chunks()` or `read()`."""

    def __init__(self, response: aiohttp.ClientResponse, idle_timeout_s: float) -> None:
        self._response = response
        self.status = response.status
        self.headers: CIMultiDictProxy[str] = response.headers
        if response.connection is not None:  # from here on, the timeout is the one between chunks
            protocol = response.connection.protocol
            protocol.read_timeout = idle_timeout_s  # type: ignore[union-attr]
            if not response.content.is_eof():
                # The running timer is the first-byte one, set when the headers arrived; engines send the first
                # chunks with them, so without a restart a pause right after would be judged by it.
                protocol.start_timeout()  # type: ignore[union-attr]

    @property
    def ok(self) -> bool:
        return self.status < 400

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; raises UpstreamFailure (BROKEN or IDLE_TIMEOUT)."""
        content = self._response.content
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    return
                yield chunk
        except _TRANSLATED as exc:
            raise _translate(exc, answered=True) from exc

    async def read_whole(self, limit_bytes: int) -> bytes | None:
        """The whole body when its declared length is at most `limit_bytes`, else None without reading any of it
        (then use `chunks()`)."""
        length = self._response.content_length
        if length is None or length > limit_bytes:
            return None
        try:
            return await self._response.read()
        except _TRANSLATED as exc:
            raise _translate(exc, answered=True) from exc

    def close(self) -> None:
        """Release the connection: back to the pool after a complete body, else closed (the engine then aborts
        the request)."""
        self._response.release() if self._response.content.at_eof() else self._response.close()


class _RelayedRequest(aiohttp.ClientRequest):
    """aiohttp's request, adding no header of its own, and sent whole in one write at the end of the event loop's
    turn.

    The body is already in memory, so its head and body go out together without the body-writer task aiohttp
    starts for every request (before Python 3.12 a task scheduled for the loop's next turn). Deferring the write to
    the end of the turn (`call_soon`) sends the requests routed in one turn back to back, which wakes a backend
    on the same host once for all of them rather than once each: ~10% less CPU a relayed request for the gateway
    and the host together at 16 connections (README, "Overhead"). At one connection it makes a round trip ~0.05 ms
    longer (the backend waits for the gateway to finish its turn); writing a lone request at once lost more at 16
    connections than it won there, as no cheap signal told "alone" from "busy" well enough.
    Passing `skip_auto_headers` would keep aiohttp's headers out too, but builds a skip list and a copy of the
    headers on every request."""

    _skip_auto_headers = CIMultiDict((name, None) for name in _NO_AUTO_HEADERS)  # still read for Content-Type
    _whole_body = b""

    def update_auto_headers(self, skip_auto_headers: Iterable[str] | None) -> None:
        pass

    def update_body_from_data(self, body: Any, _stacklevel: int = 3) -> None:
        """Keep the bytes as they are: aiohttp would wrap them in a payload for its body writer."""
        self._whole_body = body or b""
        if body or self.method not in self.GET_METHODS:
            self.headers[hdrs.CONTENT_LENGTH] = str(len(self._whole_body))

    async def send(self, conn: Connection) -> aiohttp.ClientResponse:
        protocol = conn.protocol
        transport = None if protocol is None else protocol.transport
        if protocol is None or transport is None or transport.is_closing():  # the backend closed it just now
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        version = self.version
        head = serialize_headers(f"{self.method} {self.url.raw_path_qs} HTTP/{version.major}.{version.minor}",
                                 self.headers)
        self.loop.call_soon(write_unless_closed, transport, (head, self._whole_body) if self._whole_body else (head,))
        protocol.start_timeout()
        return self.response_class(
            self.method, self.original_url, writer=None, continue100=self._continue, timer=self._timer,
            request_info=self.request_info, traces=self._traces, loop=self.loop, session=self._session,
            stream_writer=StreamWriter(protocol, self.loop))


def write_unless_closed(transport: asyncio.Transport, parts: tuple[bytes, ...]) -> None:
    """The deferred write of a request, unless its exchange failed or was cancelled meanwhile (the connection is
    then closed, and the engine never sees the request)."""
    if not transport.is_closing():
        transport.writelines(parts)


class UpstreamClient:
    """The session and its timeouts. `start()` inside the running event loop, `close()` at the end."""

    def __init__(self, connect_timeout_s: float, first_byte_timeout_s: float, idle_timeout_s: float) -> None:
        self.first_byte_timeout_s = first_byte_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._connect_timeout = aiohttp.ClientTimeout(sock_connect=connect_timeout_s)  # the connector reads only this
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0, enable_cleanup_closed=False)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False, trust_env=False,
                                              skip_auto_headers=_NO_AUTO_HEADERS, cookie_jar=aiohttp.DummyCookieJar())

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("UpstreamClient.start() was not called")
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def open(self, method: str, url: str, body: bytes, headers: Sequence[tuple[str, str]],
                   first_byte_timeout_s: float | None = None) -> UpstreamResponse:
        """Send the request and wait for the status line and headers; raises UpstreamFailure.

        aiohttp's own request, connection pool and response, without `ClientSession.request` around them: its
        cookies, redirects, proxies, authentication, traces and middlewares are nothing a relay uses, and cost
        ~6% of a relayed request's CPU (README, "Overhead"). What it would do besides is done here: the
        connect timeout told apart, the first-byte timeout set on the connection, the connection closed (so the
        engine aborts) when the exchange fails or the caller is cancelled before the headers."""
        first_byte_s = first_byte_timeout_s or self.first_byte_timeout_s
        session = self.session
        request = _RelayedRequest(method, URL(url), headers=headers, data=body or None, loop=self._loop,
                                  session=session, response_class=aiohttp.ClientResponse)
        try:
            connection = await session.connector.connect(request, [], self._connect_timeout)  # type: ignore[union-attr]
        except TimeoutError as exc:  # only the connect timeout runs here
            raise UpstreamFailure(Failure.CONNECT, "ConnectionTimeoutError") from exc
        except _TRANSLATED as exc:
            raise _translate(exc, answered=False) from exc
        connection.protocol.set_response_params(  # type: ignore[union-attr]
            read_until_eof=True, auto_decompress=False, read_timeout=first_byte_s, read_bufsize=_READ_BUFFER_BYTES)
        response = None
        try:
            response = await request.send(connection)
            await response.start(connection)
        except BaseException as exc:
            if response is not None:
                response.close()
            connection.close()
            if isinstance(exc, _TRANSLATED):
                raise _translate(exc, answered=False) from exc
            raise
        return UpstreamResponse(response, self.idle_timeout_s)

    async def get_bytes(self, url: str, timeout_s: float) -> bytes | None:
        """The body of a 200 answer to GET, or None for any other answer or failure (probes may miss)."""
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                        allow_redirects=False) as response:
                return await response.read() if response.status == 200 else None
        except _TRANSLATED:
            return None

    async def get_status(self, url: str, timeout_s: float) -> tuple[int | None, UpstreamFailure | None]:
        """The status of a GET (body discarded), or None and how it failed; raises UpstreamFailure (LOCAL) when
        the gateway itself could not try (out of descriptors): that says nothing about the backend."""
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                        allow_redirects=False) as response:
                return response.status, None
        except _TRANSLATED as exc:
            failure = _translate(exc, answered=False)
            if failure.failure is Failure.LOCAL:
                raise failure from exc
            return None, failure


def log_ignored_proxy_environment(environ: Mapping[str, str]) -> None:
    found = sorted(name for name in environ if name.upper() in PROXY_VARIABLES)
    if found:
        logger.info("proxy variables %s are set and ignored: upstream calls go directly to the backends",
                    ", ".join(found))
