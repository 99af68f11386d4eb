"""Logging set-up: one handler on the root logger, in text (the default) or JSON lines (`--log-format json`).

A JSON line is one object: `time` (ISO 8601, UTC), `level`, `logger`, `message`, then every field the call passed
with `extra=` (the access log passes request_id, backend, route, match, status, duration_ms, ...), and
`exception` with the traceback when there is one. Values JSON cannot hold are written as their `str()`.
"""

from __future__ import annotations

import asyncio
import datetime
import io
import json
import logging
import os
import sys
import time
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Attributes every LogRecord has; anything else in a record's __dict__ came from `extra=`.
_STANDARD_ATTRIBUTES = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC)
                                     .isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
        }
        entry.update((key, value) for key, value in record.__dict__.items() if key not in _STANDARD_ATTRIBUTES)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


FLUSH_INTERVAL_S = 0.2
ACCESS_LOGGER = "gateway.access"


class BufferedStderrHandler(logging.StreamHandler):
    """stderr through a 64 KiB buffer: access lines are flushed at most every FLUSH_INTERVAL_S by
    `flush_every`, every other line at once. Python's stderr writes each line with its own system call, which
    for one access line per request was the largest part of its cost."""

    text = False  # set by configure_logging when the text format is used: AccessLog may then write directly

    def __init__(self) -> None:
        try:
            raw = io.FileIO(os.dup(sys.stderr.fileno()), "w")
        except (OSError, ValueError):  # stderr is not a file (replaced, as by a test harness): write to it as is
            super().__init__(sys.stderr)
            return
        super().__init__(io.TextIOWrapper(io.BufferedWriter(raw, 65536), encoding="utf-8", errors="backslashreplace"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.stream.write(self.format(record) + self.terminator)
            if record.name != ACCESS_LOGGER or record.levelno >= logging.WARNING:
                self.flush()
        except Exception:
            self.handleError(record)


async def flush_every(interval_s: float = FLUSH_INTERVAL_S) -> None:
    """Flush the log handlers' buffers until cancelled (run by the app beside its other background tasks)."""
    try:
        while True:
            await asyncio.sleep(interval_s)
            for handler in logging.getLogger().handlers:
                handler.flush()
    finally:
        for handler in logging.getLogger().handlers:
            handler.flush()


class AccessLog:
    """One line per request on `gateway.access`: method, path, model, backend, route, match, status, error,
    duration and request id. With the text format on our handler, the line is written into its buffer directly:
    a LogRecord and its Formatter cost several times the rest of the line's work. Any other set-up (JSON lines,
    handlers a library user added) gets a record with the same fields as `extra`."""

    def __init__(self) -> None:
        self.logger = logging.getLogger(ACCESS_LOGGER)
        self._second = -1
        self._stamp = ""

    def __call__(self, method: str, path: str, model: str, backend: str, route: str, match: float, status: str,
                 error: str | None, duration_s: float, request_id: str) -> None:
        if not self.logger.isEnabledFor(logging.INFO):
            return
        duration_ms = round(duration_s * 1000, 1)
        message = (f"{method} {path} model={model} backend={backend} route={route} match={match:.3f} "
                   f"status={status}{f' error={error}' if error else ''} duration_ms={duration_ms:.1f} id={request_id}")
        handlers = logging.getLogger().handlers
        if len(handlers) == 1 and isinstance(handlers[0], BufferedStderrHandler) and handlers[0].text \
                and not self.logger.handlers:
            handlers[0].stream.write(f"{self._asctime()} INFO {ACCESS_LOGGER}: {message}\n")
            return
        self.logger.handle(self.logger.makeRecord(
            ACCESS_LOGGER, logging.INFO, __file__, 0, "%s", (message,), None,
            extra={"method": method, "path": path, "model": model, "backend": backend, "route": route,
                   "match": round(match, 3), "status": status, "error": error, "duration_ms": duration_ms,
                   "request_id": request_id}))

    def _asctime(self) -> str:
        """As logging.Formatter writes %(asctime)s, with the date and time formatted once a second."""
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second, self._stamp = second, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        return f"{self._stamp},{int((now - second) * 1000):03d}"


def configure_logging(level: str, log_format: str = "text") -> None:
    """Send every logger's records at `level` and above to stderr, as text lines or JSON lines."""
    handler = BufferedStderrHandler()
    handler.text = log_format != "json"
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # httpx2 logs every upstream call at INFO; the access log already says what happened.
    logging.getLogger("httpx2").setLevel(max(logging.WARNING, logging.getLogger().level))

