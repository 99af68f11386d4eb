"""A cap on open client connections: the server's protocol factory, bounded.

aiohttp cannot pause accepting, and an idle keep-alive connection costs a descriptor and a protocol object
until its timeout. Without a cap, connections were bounded only by the open-file limit, and a client that
exhausts it takes the descriptors the gateway needs for its backends. So the listening socket gets this
factory instead of aiohttp's server: under the cap it hands out aiohttp's own protocol (nothing changes for
that connection), above it a protocol that closes the connection at once, unanswered (aiohttp has no supported
way to answer it, and the gateway writes no HTTP of its own). Refused connections are counted
(`gateway_client_connections_refused_total`) and logged at most once per `log_interval_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

from aiohttp import web_server
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

# Descriptors kept back from the cap for what is not a socket pair: the listening socket, log files, the shared
# store, health checks and scrapes of the backends.
RESERVED_FILES = 64


def default_max_connections(open_files: int) -> int:
    """The open-file limit less `RESERVED_FILES`, halved: a client connection with a request in flight holds a
    backend connection as well, so the other half is left for those."""
    return max(16, (open_files - RESERVED_FILES) // 2)


class _Refused(asyncio.Protocol):
    """A connection over the cap: closed as soon as it is accepted, nothing read or written."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class ConnectionCap:
    def __init__(self, server: web_server.Server, max_connections: int, log_interval_s: float = 10.0) -> None:
        self.server = server
        self.max_connections = max_connections
        self.log_interval_s = log_interval_s
        self.refused_total = 0
        # Handed out but not yet in aiohttp's table: the loop accepts a burst (up to the listen backlog) before
        # any of them runs connection_made, which it schedules; our callback, scheduled after, settles the count.
        self._accepting = 0
        self._unlogged = 0
        self._logged_s = -log_interval_s

    def __call__(self) -> asyncio.BaseProtocol:
        if self.open_connections() + self._accepting < self.max_connections:
            self._accepting += 1
            asyncio.get_running_loop().call_soon(self._accepted)
            return self.server()
        self.refused_total += 1
        self._unlogged += 1
        now_s = time.monotonic()
        if now_s - self._logged_s >= self.log_interval_s:
            logger.warning("%d client connections open, the cap (--max-connections): closed %d new ones since "
                           "the last such line", self.open_connections(), self._unlogged)
            self._logged_s, self._unlogged = now_s, 0
        return _Refused()

    def _accepted(self) -> None:
        self._accepting -= 1

    def open_connections(self) -> int:
        """Connections aiohttp serves, including closed ones whose last request is still being handled. Read
        from its (private) table in O(1) where it has one; its public list is a copy."""
        table = getattr(self.server, "_connections", None)
        return len(table) if isinstance(table, dict) else len(self.server.connections)

    def export(self, registry: CollectorRegistry) -> None:
        registry.register(_ConnectionCollector(self))


class _ConnectionCollector(Collector):
    def __init__(self, cap: ConnectionCap) -> None:
        self._cap = cap

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("gateway_client_connections", "Open client connections",
                                value=float(self._cap.open_connections()))
        yield GaugeMetricFamily("gateway_client_connections_max", "The cap on open client connections "
                                "(--max-connections)", value=float(self._cap.max_connections))
        yield CounterMetricFamily("gateway_client_connections_refused", "Client connections closed unanswered "
                                  "because the cap was reached", value=float(self._cap.refused_total))
