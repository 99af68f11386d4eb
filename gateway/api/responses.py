"""Which backend holds each stored response of the OpenAI Responses API.

An engine keeps the responses it produced (`store`, on by default) in its own memory: a follow-up that names
one in `previous_response_id`, and `GET`/`DELETE /v1/responses/{id}`, only work on that engine. The gateway
reads each response's id from the answer (the JSON body's `id`, or the `response` object of the stream's last
event that carries usage: `response.completed`, or `response.created` when the stream broke early) and
remembers its backend here; requests naming the id go there while it is healthy (`StoredResponses.owner_of`).

The map is bounded in entries and in age, oldest first (every entry lives the same `ttl_s`, so the oldest is
always at the front and expiry is a pop from the left). An id this process does not know (made through another
`--workers` process, before a restart, or forgotten) is looked for (`locate`): every healthy candidate is asked
`GET /v1/responses/{id}` at once, and the first to answer 200 holds it. Found nowhere, the request is routed as
any other would be, and an engine answers for the id.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote

from gateway.errors import StoredResponseUnavailable
from gateway.fleet.backends import Backend
from gateway.fleet.pool import Pool
from gateway.fleet.upstream import UpstreamClient, UpstreamFailure

logger = logging.getLogger(__name__)


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


class StoredResponses:
    """The request path's side of stored responses: which backend a request naming one must go to, and what an
    answer teaches about them."""

    def __init__(self, owners: ResponseOwners, pool: Pool, client: UpstreamClient, probe_timeout_s: float,
                 expose_backend_urls: bool) -> None:
        self.owners = owners
        self.pool = pool
        self.client = client
        self.probe_timeout_s = probe_timeout_s
        self.expose_backend_urls = expose_backend_urls

    async def owner_of(self, response_id: Any, param: str | None, model: str | None) -> Backend | None:
        """The backend holding a stored response (of `model`, if given), None when none is known to; raises
        StoredResponseUnavailable when that backend is not healthy (no other one holds the response)."""
        if not isinstance(response_id, str):
            return None
        owner = self.owners.owner(response_id)
        if owner is None:
            candidates = [b for b in self.pool.backends
                          if b.healthy and not b.draining and (model is None or b.serves(model))]
            if len(candidates) < 2:  # routing finds the one there is
                return None
            owner = await locate(self.client, candidates, response_id, self.probe_timeout_s)
            if owner is not None:
                self.owners.remember(response_id, owner)
        if owner is None or (owner.healthy and not owner.draining):  # a draining one is leaving: sent nothing new
            return owner
        raise StoredResponseUnavailable(response_id, owner.url if self.expose_backend_urls else owner.name, param)

    def answered(self, backend: Backend, stored_id: str | None, method: str, payload: Any) -> None:
        """A successful answer from `backend`: remember which backend stored a new response (its id read from the
        payload the usage tap parsed anyway); forget a deleted one (`stored_id`: the request named it)."""
        if stored_id is None:
            response_id = response_id_of(payload)
            if response_id is not None:
                self.owners.remember(response_id, backend)
        elif method == "DELETE":
            self.owners.forget(stored_id)


def response_id_of(payload: Any) -> str | None:
    """The id of the response object in an answer: a Response, or a stream event wrapping one."""
    if not isinstance(payload, dict):
        return None
    inner = payload.get("response")
    response = inner if isinstance(inner, dict) else payload
    found = response.get("id")
    return found if isinstance(found, str) and found else None


async def locate(client: UpstreamClient, backends: Sequence[Backend], response_id: str,
                 timeout_s: float) -> Backend | None:
    """The backend among `backends` that answers 200 to `GET /v1/responses/{id}`, or None."""
    path = "/v1/responses/" + quote(response_id, safe="")

    async def holds(backend: Backend) -> Backend | None:
        headers = [("Authorization", f"Bearer {backend.spec.api_key}")] if backend.spec.api_key else []
        try:
            answer = await client.open("GET", backend.url + path, b"", headers, timeout_s)
        except UpstreamFailure:
            return None
        answer.close()  # the status is the answer; the body is not needed
        return backend if answer.status == 200 else None

    asks = [asyncio.ensure_future(holds(backend)) for backend in backends]
    try:
        async with asyncio.timeout(timeout_s):
            for asked in asyncio.as_completed(asks):
                if (found := await asked) is not None:
                    logger.info("stored response %s found on backend %s", response_id, found.url)
                    return found
    except TimeoutError:
        pass
    finally:
        for ask in asks:
            ask.cancel()
        await asyncio.gather(*asks, return_exceptions=True)
    return None
