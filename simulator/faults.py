"""Fault injection for one simulated replica: the failures a gateway must survive, switchable at runtime.

`FaultSettings` is what the CLI flags and `POST /control/faults` set (same field names); `Faults` holds the
current settings, the seeded random source that decides which requests fail (so a run is reproducible), and
the event that hung requests wait on. `DroppingEventStream` is the SSE response that carries out the drop.

Latency is real time (milliseconds), not scaled by the replica's time_scale: it models the network or a
stalled process, not the engine's work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Send

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FaultSettings:
    error_rate: float = 0.0               # fraction of inference requests answered 500, 0..1
    latency_ms: float = 0.0               # added before the response starts
    hang: bool = False                    # accept inference requests and answer none until cleared
    drop_after_chunks: int | None = None  # close a stream's connection after this many SSE chunks
    unhealthy_for_s: float = 0.0          # health probes answer 503 for this long (from start or from set)

    def __post_init__(self) -> None:
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError(f"error_rate must be within 0..1, got {self.error_rate!r}")
        if self.latency_ms < 0:
            raise ValueError(f"latency_ms must be >= 0, got {self.latency_ms!r}")
        if self.drop_after_chunks is not None and self.drop_after_chunks < 0:
            raise ValueError(f"drop_after_chunks must be >= 0 or null, got {self.drop_after_chunks!r}")
        if self.unhealthy_for_s < 0:
            raise ValueError(f"unhealthy_for_s must be >= 0, got {self.unhealthy_for_s!r}")

    @classmethod
    def from_json(cls, body: Any, base: FaultSettings) -> FaultSettings:
        """`base` updated with the fields present in `body`; a ValueError names any bad key or value."""
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        known = {field.name: field for field in dataclasses.fields(cls)}
        for key in body:
            if key not in known:
                raise ValueError(f"unknown fault {key!r}; known: {', '.join(known)}")
        return dataclasses.replace(base, **{key: _checked(key, value) for key, value in body.items()})


def _checked(key: str, value: Any) -> Any:
    if key == "hang":
        if not isinstance(value, bool):
            raise ValueError(f"hang must be true or false, got {value!r}")
        return value
    if key == "drop_after_chunks":
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"drop_after_chunks must be an integer or null, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} must be a number, got {value!r}")
    return float(value)


class Faults:
    def __init__(self, settings: FaultSettings, seed: int = 0) -> None:
        self._random = random.Random(seed)
        self._released = asyncio.Event()
        self.settings = settings
        self._unhealthy_until = 0.0
        self.apply(settings)

    def apply(self, settings: FaultSettings) -> None:
        """Make `settings` current; a nonzero unhealthy_for_s starts counting now."""
        self.settings = settings
        self._unhealthy_until = time.monotonic() + settings.unhealthy_for_s if settings.unhealthy_for_s else 0.0
        if settings.hang:
            self._released.clear()
        else:
            self._released.set()  # wakes every request hung so far

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self._unhealthy_until

    def should_fail(self) -> bool:
        rate = self.settings.error_rate
        # Draw only when the fault is on, so switching it on mid-run gives the same sequence every time.
        return rate > 0.0 and (rate >= 1.0 or self._random.random() < rate)

    async def before_response(self) -> None:
        """Wait out the injected latency and any hang, in that order."""
        if self.settings.latency_ms:
            await asyncio.sleep(self.settings.latency_ms / 1000.0)
        await self._released.wait()

    def describe(self) -> dict[str, Any]:
        shown = dataclasses.asdict(self.settings)
        shown["unhealthy_remaining_s"] = round(max(0.0, self._unhealthy_until - time.monotonic()), 3)
        return shown


class DroppingEventStream(StreamingResponse):
    """SSE that can cut the connection after `drop_after` chunks (the drop fault) and always closes its source.

    Returning without the final empty body leaves the response incomplete, so uvicorn closes the connection
    and the client sees the stream break mid-body, as when an engine process dies.
    """

    def __init__(self, events: AsyncIterator[str], drop_after: int | None) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self._events = events
        self._drop_after = drop_after

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        sent = 0
        try:
            async for chunk in self._events:
                if self._drop_after is not None and sent >= self._drop_after:
                    logger.info("dropping the connection after %s chunks (fault)", sent)
                    return
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
                sent += 1
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]
        await send({"type": "http.response.body", "body": b"", "more_body": False})
