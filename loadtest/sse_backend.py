"""A paced streaming backend: every chat request gets `--chunks` SSE chunks, one every `--interval-ms`.

Paced like an engine decoding one token per step, so a front that relays chunk by chunk delivers what is
offered (64 streams x one chunk per 2 ms = 32k chunks/s) and one that cannot keep up falls behind. nginx cannot
pace a stream, hence this small aiohttp server (`python -m loadtest.sse_backend --port 30001`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable, Sequence

from aiohttp import web

from loadtest.nginx import MODEL, MODELS

DONE = b"data: [DONE]\n\n"


def chunk_event(index: int, last: bool) -> bytes:
    """One `chat.completion.chunk` event; the last one carries the finish reason and a `usage` object."""
    chunk: dict[str, object] = {
        "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1700000000, "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": f" tok{index}"}, "finish_reason": "stop" if last else None}],
    }
    if last:
        chunk["usage"] = {"prompt_tokens": 480, "completion_tokens": index + 1, "total_tokens": 481 + index}
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def stream_events(chunks: int) -> list[bytes]:
    """The events of one answer, `[DONE]` included: built once, every request sends the same bytes."""
    return [chunk_event(i, i == chunks - 1) for i in range(chunks)] + [DONE]


def create_app(chunks: int, interval_s: float) -> web.Application:
    events = stream_events(chunks)
    models = json.dumps(MODELS).encode()

    async def health(request: web.Request) -> web.Response:
        return web.Response(body=b"")

    async def list_models(request: web.Request) -> web.Response:
        return web.Response(body=models, content_type="application/json")

    async def complete(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        start = time.monotonic()
        for index, event in enumerate(events):
            # Against a schedule, not sleep after sleep: the offered rate does not drift with the loop's delays.
            delay = start + index * interval_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await response.write(event)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_post("/v1/completions", complete)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.sse_backend", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    parser.add_argument("--chunks", type=int, default=64, help="SSE chunks per answer, [DONE] not counted")
    parser.add_argument("--interval-ms", type=float, default=2.0, help="milliseconds between a stream's chunks")
    args = parser.parse_args(argv)
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:  # only slower
        pass
    web.run_app(create_app(args.chunks, args.interval_ms / 1000), host=args.host, port=args.port,
                access_log=None, print=None, loop=loop_factory() if loop_factory else None)


if __name__ == "__main__":
    main()
