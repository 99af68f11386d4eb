"""Reading the prompt and cached token counts a backend reports, without slowing the relay.

Non-streamed bodies are kept (up to a bound) and parsed once at the end. Streams are never parsed chunk by
chunk: the tap only remembers the last complete SSE event that mentions usage (a bytes search), and that one
event is parsed when the stream ends — the final usage chunk of OpenAI's `stream_options.include_usage`, the
last `meta_info` of SGLang's `/generate` stream, the Responses API's `response.completed` or Anthropic's
`message_delta`. That parsed object is also where the gateway reads a stored response's id (`payload()`).
"""

from __future__ import annotations

import zlib
from typing import Any, NamedTuple

from gateway.api.prompts import parse_json

_USAGE_MARKERS = (b'"usage"', b'"meta_info"', b'"timings"')


class Usage(NamedTuple):
    prompt_tokens: int
    cached_tokens: int | None  # None: the backend does not report cache hits


def usage_from(payload: Any) -> Usage | None:
    """Token counts from one response object, in whichever of the engines' shapes it comes."""
    if not isinstance(payload, dict):
        return None
    usage = payload.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("input_tokens"), int):
        return _input_tokens_usage(usage)
    if not isinstance(usage, dict):  # a Responses stream event, or Anthropic's message_start
        inner = payload.get("response") or payload.get("message")
        if isinstance(inner, dict) and isinstance(inner.get("usage"), dict):
            return usage_from(inner)
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if cached is None:
            cached = _llama_cpp_cached(payload)
        return Usage(usage["prompt_tokens"], cached if isinstance(cached, int) else None)
    meta = payload.get("meta_info")  # SGLang native /generate
    if isinstance(meta, dict) and isinstance(meta.get("prompt_tokens"), int):
        cached = meta.get("cached_tokens")
        return Usage(meta["prompt_tokens"], cached if isinstance(cached, int) else None)
    timings = payload.get("timings")  # llama.cpp, when no usage object came along
    if isinstance(timings, dict) and isinstance(timings.get("prompt_n"), int):
        cached = _llama_cpp_cached(payload) or 0
        return Usage(timings["prompt_n"] + cached, cached)
    return None


def _input_tokens_usage(usage: dict[str, Any]) -> Usage:
    """The Responses API counts cached tokens inside `input_tokens` (`input_tokens_details.cached_tokens`);
    Anthropic's Messages API counts them beside it (`cache_read_input_tokens`, and the tokens written to the
    cache in `cache_creation_input_tokens`). vLLM's Messages server sends `input_tokens` alone: the whole prompt,
    hits unknown."""
    read, written = usage.get("cache_read_input_tokens"), usage.get("cache_creation_input_tokens")
    if isinstance(read, int) or isinstance(written, int):
        read = read if isinstance(read, int) else 0
        return Usage(usage["input_tokens"] + read + (written if isinstance(written, int) else 0), read)
    details = usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(usage["input_tokens"], cached if isinstance(cached, int) else None)


def _llama_cpp_cached(payload: dict[str, Any]) -> int | None:
    """llama.cpp's server reports reused prompt tokens as `timings.cache_n`."""
    timings = payload.get("timings")
    cached = timings.get("cache_n") if isinstance(timings, dict) else None
    return cached if isinstance(cached, int) else None


class UsageTap:
    """Reads what the engine sent: a body the client asked to have gzip- or deflate-encoded is decoded for the
    tap only (the client gets the bytes as they came); other encodings are not read."""

    def __init__(self, streaming: bool, content_encoding: str | None = None,
                 max_body_bytes: int = 8 * 1024 * 1024) -> None:
        self._streaming = streaming
        encoding = (content_encoding or "identity").strip().lower()
        self._decoder = zlib.decompressobj(wbits=47) if encoding in ("gzip", "x-gzip", "deflate") else None
        self._readable = self._decoder is not None or encoding == "identity"
        self._max_body_bytes = max_body_bytes
        self._buffer = bytearray()
        self._last_usage_event = b""
        self._body_too_big = False
        self._payload: Any = None
        self._parsed = False

    def feed(self, chunk: bytes) -> None:
        if self._decoder is not None:
            try:
                chunk = self._decoder.decompress(chunk, self._max_body_bytes)
            except zlib.error:
                self._decoder, self._readable = None, False
        if not self._readable:
            return
        if not self._streaming:
            if not self._body_too_big:
                self._buffer += chunk
                if len(self._buffer) > self._max_body_bytes:  # no usage read from it: stop holding it
                    self._body_too_big = True
                    self._buffer.clear()
            return
        self._buffer += chunk
        cut = self._buffer.rfind(b"\n\n")
        if cut < 0:
            if len(self._buffer) > self._max_body_bytes:  # one absurd event: give up on it, keep relaying
                self._buffer.clear()
            return
        complete = bytes(self._buffer[:cut])
        del self._buffer[: cut + 2]
        for event in reversed(complete.split(b"\n\n")):
            if any(marker in event for marker in _USAGE_MARKERS):
                self._last_usage_event = event
                return

    def usage(self) -> Usage | None:
        return usage_from(self.payload())

    def payload(self) -> Any:
        """The answer's object that carries usage, parsed once: the whole body, or the data of the stream's
        last usage event; None when there is none (or the body was too big or not readable)."""
        if not self._parsed:
            self._parsed = True
            self._payload = self._read_payload()
        return self._payload

    def _read_payload(self) -> Any:
        if not self._readable:
            return None
        if not self._streaming:
            return _loads(bytes(self._buffer))
        for line in self._last_usage_event.splitlines():
            if line.startswith(b"data:"):
                return _loads(line[5:].strip())
        return None


def _loads(data: bytes) -> Any:
    try:
        return parse_json(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
