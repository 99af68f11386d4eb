"""The shutdown drain: what a stopping gateway waits for, and how it ends what outlasts the grace period.

Requests are either unanswered (queued for a slot, being parsed, waiting for the backend's first byte) or
answering (a `Relay` is sending the backend's answer). On SIGTERM `announce()` turns /ready to 503 (for
`--shutdown-delay-secs` the port still serves), then the server stops accepting and `drain()` gives
both `grace_s` to finish; then an open answer ends with an SSE error event (its `Relay`), and an unanswered
request is cancelled and answered 503 `shutting_down` with Retry-After, so the client can retry elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

from aiohttp import web

from gateway.api.relay import Relay
from gateway.errors import ShuttingDown

logger = logging.getLogger(__name__)


class Drain:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.stopping = False
        self.open_relays: set[Relay] = set()
        self._unanswered: set[asyncio.Task[Any]] = set()
        self._cut: set[asyncio.Task[Any]] = set()

    async def guard(self, handling: Awaitable[web.StreamResponse]) -> web.StreamResponse:
        """Run a request's handling; one still unanswered when the grace ends gets 503."""
        task = asyncio.current_task()
        assert task is not None
        self._unanswered.add(task)
        try:
            return await handling
        except asyncio.CancelledError:
            if task not in self._cut:
                raise
            task.uncancel()  # our own stop, not the client's: it gets an answer it can retry elsewhere
            raise ShuttingDown("The gateway is shutting down; retry the request.") from None
        finally:
            self._unanswered.discard(task)

    def answering(self) -> None:
        """The current request starts relaying an answer: from here on, a shutdown ends it through its Relay."""
        if (task := asyncio.current_task()) is not None:
            self._unanswered.discard(task)

    def cut_by_shutdown(self) -> bool:
        """Whether the current request was cancelled by `drain`, not by its client."""
        return asyncio.current_task() in self._cut

    async def announce(self, delay_s: float) -> None:
        """A stop signal arrived: /ready answers 503 from now on while the gateway keeps serving for `delay_s`,
        so that load balancers probing it stop sending before the port closes."""
        self.stopping = True
        if delay_s > 0:
            logger.info("stopping: /ready answers 503; still serving for %g s before closing the port", delay_s)
            await asyncio.sleep(delay_s)

    async def drain(self) -> None:
        """The server has stopped accepting: wait up to `grace_s` for what is in flight, then end the rest."""
        self.stopping = True
        logger.info("shutting down: %d requests in flight get up to %g s",
                    len(self.open_relays) + len(self._unanswered), self.grace_s)
        deadline = time.monotonic() + self.grace_s
        while (self.open_relays or self._unanswered) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for relay in list(self.open_relays):
            relay.stop_for_shutdown()
        for task in list(self._unanswered):  # still queued or waiting for the backend: answered 503
            self._cut.add(task)
            task.cancel()
