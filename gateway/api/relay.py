"""Relaying an opened upstream answer to the client, and how the exchange ended (`Outcome`).

A small non-streamed answer is read whole and sent in one write; anything else goes out chunk by chunk as it
arrives, never coalesced. The usage tap reads the token counts on the way. A client that leaves cancels the
handler (the server's `handler_cancellation`): the upstream connection is closed at once, so the engine aborts
the request. A client that stops reading is given `write_timeout_s` to drain its buffer, then dropped the same
way. A stream that breaks mid-way, or is ended by a shutdown, closes with an SSE `error` event the client's SDK
raises (Anthropic's `event: error` on its Messages API). Whatever way it ends, `Outcome` says so once, to the
record step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum

from aiohttp import web

from gateway.api.headers import relayed_headers
from gateway.api.usage import Usage, UsageTap
from gateway.errors import ErrorShape, GatewayError, GatewayOverloaded, ShuttingDown, UpstreamError, UpstreamTimeout
from gateway.fleet.upstream import Failure, UpstreamFailure, UpstreamResponse

logger = logging.getLogger(__name__)

FirstByte = Callable[[], None]  # called once at a success's first byte (an error answer prefilled nothing)

WHOLE_BODY_BYTES = 1024 * 1024  # non-streamed answers of a declared length up to this are sent in one write
# A chunk this small, written when nothing is queued for the client, cannot fill the transport's buffer past its
# high-water mark (64 KiB), so the write cannot block; any other write may block for as long as the client does
# not read, and is bounded by write_timeout_s.
_DIRECT_WRITE_BYTES = 16 * 1024


def _may_block(transport: asyncio.Transport | None, size: int) -> bool:
    """Whether writing `size` more bytes to the client may wait for it to read (`_DIRECT_WRITE_BYTES`)."""
    return transport is not None and (transport.get_write_buffer_size() > 0 or size > _DIRECT_WRITE_BYTES)


class Ending(str, Enum):
    """How an exchange ended when it did not end as the backend meant it to."""

    CLIENT_GONE = "client_disconnect"
    SLOW_CLIENT = "slow_client"
    SHUTDOWN = "shutdown"


@dataclass
class Outcome:
    """How a relayed exchange ended, for the record step."""

    status: int
    usage: Usage | None = None
    failure: Failure | None = None   # the backend's part, when it failed
    ending: Ending | None = None     # the client's or ours, when that ended it
    ttfb_s: float | None = None

    @property
    def label(self) -> str:
        """The status as metrics and the access log show it: 499 when the client was gone."""
        return "499" if self.ending in (Ending.CLIENT_GONE, Ending.SLOW_CLIENT) else str(self.status)

    @property
    def error(self) -> str | None:
        if self.ending is not None:
            return self.ending.value
        return self.failure.value if self.failure is not None else None


def error_for(failure: UpstreamFailure) -> GatewayError:
    """What a client is told about a failed exchange: the backend's failure, or the gateway's own."""
    if failure.failure is Failure.LOCAL:
        return GatewayOverloaded(f"The gateway ran out of resources ({failure.detail}).")
    if failure.failure.timed_out:
        return UpstreamTimeout(f"The backend did not answer in time ({failure.detail}).", code="upstream_timeout")
    return UpstreamError(f"The backend broke the exchange ({failure.detail}).", code="upstream_broken")


class Relay:
    """One answer on its way to the client."""

    def __init__(self, request: web.Request, upstream: UpstreamResponse, extra_headers: dict[str, str],
                 streaming: bool, placed_s: float, write_timeout_s: float) -> None:
        self.request = request
        self.upstream = upstream
        self.extra_headers = extra_headers
        self.streaming = streaming
        self.placed_s = placed_s
        self.write_timeout_s = write_timeout_s
        self.tap = UsageTap(streaming, upstream.headers.get("content-encoding"))
        self.outcome = Outcome(status=upstream.status)
        self.response: web.StreamResponse | None = None
        self._task: asyncio.Task[object] | None = None

    async def run(self, on_first_byte: FirstByte) -> web.StreamResponse:
        """Relay the answer; the outcome is in `self.outcome` however this ends (also when it raises)."""
        self._task = asyncio.current_task()
        try:
            if not self.streaming:
                body = await self.upstream.read_whole(WHOLE_BODY_BYTES)
                if body is not None:
                    return await self._whole(body, on_first_byte)
            return await self._streamed(on_first_byte)
        except UpstreamFailure as exc:
            self.outcome.failure = exc.failure
            if self.response is None:  # nothing sent yet: the client gets a proper error answer
                raise error_for(exc) from exc
            await self._end_with_error(error_for(exc))
            return self.response
        except asyncio.CancelledError:
            if self.outcome.ending is not Ending.SHUTDOWN or self._task is None:
                self.outcome.ending = self.outcome.ending or Ending.CLIENT_GONE
                raise
            self._task.uncancel()  # our own stop, not the client's: end the stream properly
            await self._end_with_error(ShuttingDown("The gateway is shutting down; retry the request."))
            return self.response or web.Response(status=503)
        except ConnectionError:  # the client's connection closed under our write, or we dropped a slow one
            self.outcome.ending = self.outcome.ending or Ending.CLIENT_GONE
            return self.response or web.Response(status=499)
        finally:
            self.upstream.close()
            self.outcome.usage = self.tap.usage()

    async def _whole(self, body: bytes, on_first_byte: FirstByte) -> web.Response:
        self._first_byte(on_first_byte)
        self.tap.feed(body)
        response = web.Response(body=body, status=self.upstream.status)
        self._copy_headers(response)
        transport = self.request.transport
        if transport is not None and not _may_block(transport, len(body)):
            # A write that cannot block, made here rather than by the server after the handler returns: the record
            # step then runs while the answer is on its way, not before it leaves. A larger one is left to the
            # server, so that a client slow to read never holds the backend's placement.
            self.response = response
            await response.prepare(self.request)
            await response.write_eof()
        return response

    async def _streamed(self, on_first_byte: FirstByte) -> web.StreamResponse:
        response = self.response = web.StreamResponse(status=self.upstream.status)
        self._copy_headers(response)
        await response.prepare(self.request)
        transport = self.request.transport
        async for chunk in self.upstream.chunks():
            if self.outcome.ttfb_s is None:
                self._first_byte(on_first_byte)
            self.tap.feed(chunk)
            if _may_block(transport, len(chunk)):
                await self._bounded(response.write(chunk))
            else:
                await response.write(chunk)
        await (self._bounded(response.write_eof()) if _may_block(transport, 0) else response.write_eof())
        return response

    async def _bounded(self, write: Awaitable[None]) -> None:
        """A write that may wait for the client to read: give it `write_timeout_s`, then drop the client (and so
        the upstream request)."""
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await write
        except TimeoutError:
            self.outcome.ending = Ending.SLOW_CLIENT
            logger.warning("client of request %s stopped reading; dropped after %.0f s",
                           self.extra_headers.get("x-request-id"), self.write_timeout_s)
            if self.request.transport is not None:
                self.request.transport.abort()
            raise ConnectionResetError("client stopped reading") from None

    def _first_byte(self, on_first_byte: FirstByte) -> None:
        self.outcome.ttfb_s = time.monotonic() - self.placed_s
        if self.upstream.ok:
            on_first_byte()

    def _copy_headers(self, response: web.StreamResponse) -> None:
        headers = response.headers
        for name, value in relayed_headers(self.upstream.headers):
            headers.add(name, value)
        headers.update(self.extra_headers)

    def stop_for_shutdown(self) -> None:
        """The shutdown grace ran out with this answer still open: end it with an error event."""
        if self._task is not None and not self._task.done():
            self.outcome.ending = Ending.SHUTDOWN
            self._task.cancel()

    async def _end_with_error(self, error: GatewayError) -> None:
        """Headers are gone already; tell a streaming client in-band, as an SSE error event it can parse."""
        logger.warning("request %s ended mid-answer: %s", self.extra_headers.get("x-request-id"), error.message)
        if self.response is None or self.request.transport is None or self.request.transport.is_closing():
            return
        try:
            if self.streaming:
                shape = ErrorShape.for_path(self.request.path)
                named = b"event: error\n" if shape is ErrorShape.ANTHROPIC else b""
                await self.response.write(named + b"data: " + json.dumps(error.body(shape)).encode() + b"\n\n")
            await self.response.write_eof()
        except ConnectionError:
            pass

