"""Which backend holds each stored response of the OpenAI Responses API.

An engine keeps the responses it produced (`store`, on by default) in its own memory: a follow-up that names
one in `previous_response_id`, and `GET`/`DELETE /v1/responses/{id}`, only work on that engine. The gateway
reads each response's id from the answer (the JSON body's `id`, or the `response` object of the stream's last
event that carries usage: `response.completed`, or `response.created` when the stream broke early) and
remembers its backend here; requests naming the id go there while it is healthy (`Gateway.owner_of`).

The map is bounded in entries and in age, oldest first (every entry lives the same `ttl_s`, so the oldest is
always at the front and expiry is a pop from the left). An id the gateway does not know (made before a
restart, by another worker, or forgotten) is routed as any request would be, and the engine answers for it.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from gateway.backends import Backend


class ResponseOwners:
    def __init__(self, max_ids: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_ids = max_ids
        self.ttl_s = ttl_s
        self._clock = clock
        self._owners: collections.OrderedDict[str, tuple[Backend, float]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def remember(self, response_id: str, backend: Backend) -> None:
        now = self._clock()
        self._owners.pop(response_id, None)
        self._owners[response_id] = (backend, now)
        self._expire(now)
        while len(self._owners) > self.max_ids:
            self._owners.popitem(last=False)

    def owner(self, response_id: str) -> Backend | None:
        """The backend that produced `response_id`, or None when it is unknown or its record has expired."""
        self._expire(self._clock())
        found = self._owners.get(response_id)
        return found[0] if found is not None else None

    def forget(self, response_id: str) -> None:
        self._owners.pop(response_id, None)

    def _expire(self, now: float) -> None:
        while self._owners:
            _, (_, at) = next(iter(self._owners.items()))
            if now - at < self.ttl_s:
                return
            self._owners.popitem(last=False)


def response_id_of(payload: Any) -> str | None:
    """The id of the response object in an answer: a Response, or a stream event wrapping one."""
    if not isinstance(payload, dict):
        return None
    inner = payload.get("response")
    response = inner if isinstance(inner, dict) else payload
    found = response.get("id")
    return found if isinstance(found, str) and found else None
