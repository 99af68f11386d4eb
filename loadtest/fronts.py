"""The fronts `python -m loadtest overhead` compares, started in front of one backend: none (direct),
sglang-router, smg, and the gateway with a policy (and optionally two worker processes).

Each is started, then asked chat requests until one answers 200: routers register their workers in the
background, and a front that answers /health is not yet one that relays.
"""

from __future__ import annotations

import asyncio
import http.client
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import aiohttp
import httpx2

from loadtest.runner import PEERS, SGLANG_ROUTER, SMG, peer_missing
from loadtest.wrk import CHAT_PATH
from simulator.fleet import Fleet, FleetError

DIRECT = "direct"
GATEWAY_ROUND_ROBIN = "gateway-round_robin"
GATEWAY_PREFIX_AWARE = "gateway-prefix_aware"
GATEWAY_WORKERS2 = "gateway-prefix_aware-workers2"
FRONTS = (DIRECT, SGLANG_ROUTER, SMG, GATEWAY_ROUND_ROBIN, GATEWAY_PREFIX_AWARE, GATEWAY_WORKERS2)
DEFAULT_FRONTS = FRONTS[:-1]
GATEWAY_ARGS = {
    GATEWAY_ROUND_ROBIN: ["--policy", "round_robin"],
    GATEWAY_PREFIX_AWARE: ["--policy", "prefix_aware"],
    GATEWAY_WORKERS2: ["--policy", "prefix_aware", "--workers", "2"],
}


@dataclass(frozen=True)
class Front:
    name: str
    url: str
    pid: int | None  # the process whose tree is the front's cost; None for direct


def missing(name: str) -> str | None:
    """Why front `name` cannot run here, or None when it can."""
    return peer_missing(name) if name in PEERS else None


def start_front(fleet: Fleet, name: str, backend: str, probe_body: str) -> Front:
    """Start front `name` before `backend` and return it once it relays `probe_body` with a 200."""
    if name == DIRECT:
        return Front(name, backend, None)
    if name == SGLANG_ROUTER:
        process = fleet.start_sglang_router([backend], policy="round_robin")
    elif name == SMG:
        process = fleet.start_smg([backend], policy="round_robin")
    elif name in GATEWAY_ARGS:
        process = fleet.start_gateway([backend], args=GATEWAY_ARGS[name], name=name)
    else:
        raise ValueError(f"unknown front {name!r}; known: {', '.join(FRONTS)}")
    wait_relaying(process.url, probe_body, name)
    return Front(name, process.url, process.popen.pid)


def wait_relaying(url: str, body: str, name: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    status: object = None
    with httpx2.Client(trust_env=False, timeout=10.0) as client:
        while time.monotonic() < deadline:
            try:
                response = client.post(url + CHAT_PATH, content=body, headers={"Content-Type": "application/json"})
                if response.status_code == 200:
                    return
                status = response.status_code
            except httpx2.HTTPError as exc:
                status = exc
            time.sleep(0.2)
    raise FleetError(f"{name} at {url} did not relay a chat request within {timeout_s:.0f} s (last: {status})")


@dataclass(frozen=True)
class StreamReads:
    """One stream read through a front: the reads that delivered it, its events, and the most events one read
    delivered. Relayed chunk by chunk, a paced stream takes about one read per event, a few at most when the
    machine delays the backend's timer; a front that coalesces packs many events into each read."""

    reads: int
    events: int
    max_events_per_read: int


async def _read_stream(session: aiohttp.ClientSession, url: str, body: str) -> StreamReads:
    reads = events = most = 0
    async with session.post(url + CHAT_PATH, data=body, headers={"Content-Type": "application/json"}) as resp:
        resp.raise_for_status()
        async for data in resp.content.iter_any():
            count = data.count(b"data: ")
            reads, events, most = reads + 1, events + count, max(most, count)
    return StreamReads(reads, events, most)


async def read_streams(url: str, body: str, tries: int) -> StreamReads:
    async with aiohttp.ClientSession() as session:
        found = [await _read_stream(session, url, body) for _ in range(tries)]
    return max(found, key=lambda r: r.reads)


def stream_reads(url: str, body: str, tries: int = 3) -> StreamReads:
    """Read a paced stream through a front, one at a time, `tries` times; the one with the most reads (the
    least disturbed by other programs on the machine)."""
    return asyncio.run(read_streams(url, body, tries))


@contextmanager
def idle_connections(url: str, body: str, count: int) -> Iterator[None]:
    """`count` client connections to a front, each left open and idle after one answered request, until the block
    ends. (http.client reads no proxy variables.)"""
    address = urllib.parse.urlsplit(url)
    connections: list[http.client.HTTPConnection] = []
    try:
        for _ in range(count):
            connection = http.client.HTTPConnection(address.hostname or "127.0.0.1", address.port, timeout=10)
            connections.append(connection)
            connection.request("POST", CHAT_PATH, body=body, headers={"Content-Type": "application/json"})
            connection.getresponse().read()
        yield
    finally:
        for connection in connections:
            connection.close()


def front_names(text: str, skip_peers: bool) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in FRONTS]
    if unknown:
        raise ValueError(f"unknown front(s) {', '.join(unknown)}; known: {', '.join(FRONTS)}")
    return [name for name in names if not (skip_peers and name in PEERS)]
