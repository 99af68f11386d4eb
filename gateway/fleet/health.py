"""Background upkeep of the pool: active health checks with model discovery, and load-metric scrapes.

Health: every `interval_s`, `GET /health` on each backend concurrently. `failure_threshold` failures in a row
take a backend out, `success_threshold` successes bring it back; on each good check the backend's model (and,
when it changed or is new, its engine and KV capacity) is (re)discovered, unless pinned in config. What each
result does to the backend is the backend's own business (`Backend.health_check_passed` and the like). Failures
of real requests are read by outlier ejection (outlier.py), without waiting for a check.

Load signals: every `metrics_interval_s`, `GET /metrics` on each healthy backend, read into `Backend.signals`
with the time of reading; policies ignore signals older than their staleness bound. The same scrape carries the
engine's `process_start_time_seconds` (vLLM exports it): when it moves, the engine restarted and the
backend's index is cleared (`Backend.start_time_read`).

Each round covers the pool as it is then: a backend added at run time is checked at once (`check_soon`) and in
every round after; a removed one is in no round.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from gateway.config import GatewayConfig
from gateway.fleet.backends import Backend
from gateway.fleet.engines import discover_engine, discover_model, read_load, read_start_time, scrape_metrics
from gateway.fleet.pool import Pool
from gateway.fleet.upstream import Failure, UpstreamClient, UpstreamFailure

logger = logging.getLogger(__name__)


class Upkeep:
    def __init__(self, pool: Pool, client: UpstreamClient, config: GatewayConfig) -> None:
        self.pool = pool
        self.client = client
        self.config = config
        self._tasks: list[asyncio.Task[None]] = []
        self._soon: set[asyncio.Task[None]] = set()  # first checks of backends added at run time

    async def start(self) -> None:
        """One full round of checks before serving, so /ready and routing are right from the first request."""
        await self.check_all()
        self._tasks.append(asyncio.create_task(self._every(self.config.health.interval_s, self.check_all)))
        if self.config.metrics_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._every(self.config.metrics_interval_s, self.scrape_all)))

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._soon]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    def check_soon(self, backend: Backend) -> None:
        """Check a backend just added now, not at the next round: it joins after its first good check. Before
        `start`, its first full round covers it."""
        if not self._tasks:
            return
        task = asyncio.create_task(self.check(backend))
        self._soon.add(task)
        task.add_done_callback(self._soon.discard)

    async def _every(self, interval_s: float, work: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await work()
            except Exception:  # one bad round must not end the upkeep
                logger.exception("background round failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(backend) for backend in self.pool.backends))

    async def check(self, backend: Backend) -> None:
        try:
            status, failure = await self.client.get_status(backend.url + "/health", self.config.health.timeout_s)
        except UpstreamFailure as exc:  # the gateway's own resources ran out: no verdict on the backend
            logger.warning("health check of %s skipped: %s", backend.url, exc.detail)
            return
        if backend not in self.pool.backends:  # removed while its check ran: no verdict brings it back
            return
        health = self.config.health
        if status is None or not 200 <= status < 300:
            reason = f"GET /health failed: {failure.detail}" if failure else f"GET /health answered {status}"
            refused = failure is not None and failure.failure is Failure.CONNECT
            backend.health_check_failed(reason, health.failure_threshold, refused=refused)
            return
        await self._discover(backend)
        if backend not in self.pool.backends:
            return
        if backend.model is None:
            backend.health_check_failed("its model could not be discovered", health.failure_threshold)
        else:
            backend.health_check_passed(health.success_threshold)

    async def _discover(self, backend: Backend) -> None:
        timeout_s = self.config.health.timeout_s
        if backend.discovered_model(await discover_model(self.client, backend.url, timeout_s)):
            self.pool.models_changed()
        if backend.engine is None:
            backend.discovered_engine(await discover_engine(self.client, backend.url, timeout_s),
                                      self.config.index_capacity_blocks)

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(b) for b in self.pool.backends if b.healthy))

    async def scrape(self, backend: Backend) -> None:
        families = await scrape_metrics(self.client, backend.url, self.config.health.timeout_s)
        if not families:
            return
        load = read_load(families)
        if load is not None:
            backend.load_read(*load)
        started_at_s = read_start_time(families)
        if started_at_s is not None:
            backend.start_time_read(started_at_s)
