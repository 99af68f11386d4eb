"""Overload is shed, not queued without bound: at most `max_concurrent` requests are relayed at once.

Requests beyond that wait in arrival order for up to `max_wait_s`, then get 429 with `Retry-After`. A slot is
handed straight from a finishing request to the oldest waiter, so a waiter is never overtaken. The health,
readiness and metrics endpoints never pass through here: they answer at once under any load.
"""

from __future__ import annotations

import asyncio
import collections
import math

from gateway.errors import Overloaded


class Admission:
    def __init__(self, max_concurrent: int, max_wait_s: float) -> None:
        self.max_concurrent = max_concurrent
        self.max_wait_s = max_wait_s
        self.in_flight = 0
        self.shed = 0  # requests refused so far
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def enter(self) -> None:
        """Take a slot, waiting for one if need be; raises Overloaded when none frees up in time."""
        if self.in_flight < self.max_concurrent and not self._waiters:
            self.in_flight += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.max_wait_s):
                await waiter
        except TimeoutError:
            self._give_up(waiter)
            self._refuse()
        except asyncio.CancelledError:  # the client left while waiting
            self._give_up(waiter)
            raise

    def _give_up(self, waiter: asyncio.Future[None]) -> None:
        """Stop waiting: pass on a slot handed over just now, or leave the queue. The timeout's cancellation
        cancels the waiter too, and a cancelled waiter was handed nothing."""
        if waiter.done() and not waiter.cancelled():
            self.leave()
        elif waiter in self._waiters:  # `leave` may have dropped it already, as done
            self._waiters.remove(waiter)

    def _refuse(self) -> None:
        self.shed += 1
        raise Overloaded(f"The gateway is at its limit of {self.max_concurrent} concurrent requests; retry later.",
                         max(1, math.ceil(self.max_wait_s)))

    def leave(self) -> None:
        """Give the slot back, to the oldest waiter if there is one."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.in_flight -= 1
