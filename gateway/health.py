"""Background upkeep of the pool: active health checks with model discovery, and load-metric scrapes.

Health: every `interval_s`, `GET /health` on each backend concurrently. `failure_threshold` failures in a row
take a backend out, `success_threshold` successes bring it back; on each good check the backend's model (and,
when it changed or is new, its engine and KV capacity) is (re)discovered, unless pinned in config. A connect
error during a real request marks the backend down at once (`Backend.mark_down`), without waiting for a check.

Load signals: every `metrics_interval_s`, `GET /metrics` on each healthy backend, read into `Backend.signals`
with the time of reading; policies ignore signals older than their staleness bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from gateway.backends import Backend, LoadSignals, Pool
from gateway.config import GatewayConfig
from gateway.engines import discover_engine, discover_model, read_load, scrape_metrics
from gateway.upstream import UpstreamClient

logger = logging.getLogger(__name__)


class Upkeep:
    def __init__(self, pool: Pool, client: UpstreamClient, config: GatewayConfig) -> None:
        self.pool = pool
        self.client = client
        self.config = config
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """One full round of checks before serving, so /ready and routing are right from the first request."""
        await self.check_all()
        self._tasks.append(asyncio.create_task(self._every(self.config.health.interval_s, self.check_all)))
        if self.config.metrics_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._every(self.config.metrics_interval_s, self.scrape_all)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

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
        ok, reason = await self._probe_health(backend)
        if ok:
            await self._discover(backend)
            ok = backend.model is not None
            reason = "its model could not be discovered"
        health = self.config.health
        if ok:
            backend.consecutive_failures = 0
            backend.consecutive_successes += 1
            if not backend.healthy and backend.consecutive_successes >= health.success_threshold:
                backend.mark_up()
        else:
            backend.consecutive_successes = 0
            backend.consecutive_failures += 1
            if backend.healthy and backend.consecutive_failures >= health.failure_threshold:
                backend.mark_down(reason)
            elif not backend.healthy and backend.consecutive_failures == 1:
                logger.warning("backend %s is not healthy: %s", backend.url, reason)

    async def _probe_health(self, backend: Backend) -> tuple[bool, str]:
        status, failure = await self.client.get_status(backend.url + "/health", self.config.health.timeout_s)
        if status is None:
            return False, f"GET /health failed: {failure}"
        if 200 <= status < 300:
            return True, ""
        return False, f"GET /health answered {status}"

    async def _discover(self, backend: Backend) -> None:
        timeout_s = self.config.health.timeout_s
        found = await discover_model(self.client, backend.url, timeout_s)
        if backend.spec.model is None and found is not None and found.model != backend.model:
            if backend.model is not None:
                logger.warning("backend %s now serves %s (was %s)", backend.url, found.model, backend.model)
                backend.index.clear()
            backend.model = found.model
            backend.engine = None  # a new model may be a new engine: look again
        if found is not None:
            backend.model_card = found.card if found.model == backend.model else {}
        if backend.engine is None:
            engine = await discover_engine(self.client, backend.url, timeout_s)
            backend.engine = engine.engine
            backend.capacity_tokens = backend.spec.capacity_tokens or engine.capacity_tokens
            backend.index.capacity_blocks = self.config.index_capacity_blocks(backend.capacity_tokens)
            logger.info("backend %s: %s engine, model %s, KV capacity %s tokens", backend.url, backend.engine.value,
                        backend.model, backend.capacity_tokens or "unknown")

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(b) for b in self.pool.backends if b.healthy))

    async def scrape(self, backend: Backend) -> None:
        families = await scrape_metrics(self.client, backend.url, self.config.health.timeout_s)
        load = read_load(families) if families else None
        if load is not None:
            backend.signals = LoadSignals(*load, read_at_s=time.monotonic(), ours_prefilling=backend.prefilling)
