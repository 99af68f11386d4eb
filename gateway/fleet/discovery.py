"""Backends at run time: found through DNS or a watched file, added and removed through the admin API.

A *source* says which backend URLs should be there now: a DNS name's A/AAAA records (`DnsSource`, a Kubernetes
headless Service lists one per ready pod) or the lines of a file (`FileSource`). A `Watch` asks its source every
interval and diffs the answer against the previous one (`diff`): a new URL joins the pool, unhealthy until its
first good health check; a vanished one drains (chosen for nothing new, its requests in flight finish) and leaves
once nothing of it is in flight (`Membership`). A source that cannot answer (DNS failure, unreadable or malformed
file) changes nothing: a name server's hiccup must not drain the fleet.

Every source manages only the backends it added: a URL also given by `--backend` (or by another source) stays
its owner's. A URL that comes back while it drains is taken back into rotation. Removal frees what the gateway
kept for the backend: its prefix index and its metric series.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from gateway.fleet.backends import Backend, BackendSpec
from gateway.fleet.pool import Pool

logger = logging.getLogger(__name__)

REAP_INTERVAL_S = 0.1  # how soon a drained backend leaves once its last request finished
FILE_POLL_S = 1.0  # a stat() per second: cheap, and an edit takes effect within a second

Resolver = Callable[[str, int], Awaitable[list[str]]]  # (host, port) -> addresses


@dataclass(frozen=True)
class DnsName:
    """`HOST:PORT` (or `http(s)://HOST:PORT`) of a DNS name whose addresses are the backends."""

    host: str
    port: int
    scheme: str = "http"

    @classmethod
    def parse(cls, text: str) -> DnsName:
        parts = urlsplit(text if "://" in text else "//" + text)
        if parts.scheme not in ("", "http", "https") or parts.path.strip("/") or parts.query:
            raise ValueError("expected HOST:PORT or http(s)://HOST:PORT")
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        if not parts.hostname or port is None:
            raise ValueError("expected HOST:PORT, with the port")
        return cls(parts.hostname, port, parts.scheme or "http")

    def url(self, address: str) -> str:
        host = f"[{address}]" if ":" in address else address
        return f"{self.scheme}://{host}:{self.port}"

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def diff(known: Collection[str], found: Collection[str]) -> tuple[list[str], list[str]]:
    """(joined, left): the URLs in `found` and not in `known`, and the other way round, each sorted."""
    return sorted(set(found) - set(known)), sorted(set(known) - set(found))


def parse_backend_file(text: str) -> list[str]:
    """The URLs of a backend file: one per line, `#` starts a comment, blank lines are skipped. Raises ValueError
    naming the first bad line, so that a file caught half-written changes nothing."""
    urls = []
    for number, line in enumerate(text.splitlines(), 1):
        url = line.split("#", 1)[0].strip().rstrip("/")
        if not url:
            continue
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"line {number} is not an http(s) URL: {line.strip()!r}")
        urls.append(url)
    return urls


def name_of(url: str) -> str:
    """The name clients are told for a discovered backend: its address and port."""
    return urlsplit(url).netloc


async def resolve(host: str, port: int) -> list[str]:
    """The addresses of `host`, through the event loop's resolver (getaddrinfo in a thread)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class Source(Protocol):
    name: str  # the backends' `source`: "dns:HOST:PORT" or "file:PATH"
    interval_s: float

    async def read(self) -> set[str] | None:
        """The URLs that should be there now; None when that cannot be told (or, for a file, did not change)."""
        ...


class DnsSource:
    def __init__(self, target: DnsName, interval_s: float, resolver: Resolver = resolve) -> None:
        self.target = target
        self.name = f"dns:{target}"
        self.interval_s = interval_s
        self._resolver = resolver
        self._failing = False

    async def read(self) -> set[str] | None:
        try:
            addresses = await self._resolver(self.target.host, self.target.port)
        except OSError as exc:  # socket.gaierror included: keep the backends we have
            if not self._failing:
                logger.warning("backend DNS name %s does not resolve (%s); its backends stay as they are",
                               self.target, exc)
            self._failing = True
            return None
        if self._failing:
            logger.info("backend DNS name %s resolves again", self.target)
        self._failing = False
        return {self.target.url(address) for address in addresses}


class FileSource:
    def __init__(self, path: str, interval_s: float = FILE_POLL_S) -> None:
        self.path = path
        self.name = f"file:{path}"
        self.interval_s = interval_s
        self._seen: tuple[int, int, int] | None = None  # (mtime_ns, size, inode) of the version last read
        self._problem: str | None = None

    async def read(self) -> set[str] | None:
        try:
            stat = os.stat(self.path)
            stamp = (stat.st_mtime_ns, stat.st_size, stat.st_ino)  # an atomic rename changes the inode
            if stamp == self._seen:
                return None
            with open(self.path, encoding="utf-8") as file:
                urls = parse_backend_file(file.read())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            self._complain(str(exc))
            return None
        self._seen, self._problem = stamp, None
        return set(urls)

    def _complain(self, problem: str) -> None:
        if problem != self._problem:
            logger.warning("backend file %s not applied: %s; its backends stay as they are", self.path, problem)
        self._problem = problem


class Membership:
    """Joins and leaves, applied to the pool and to what keeps something per backend: a joined backend gets its
    first health check at once (`on_join`); a leaving one drains, then leaves the pool (`on_leave` forgets its
    metrics) once nothing of it is in flight."""

    def __init__(self, pool: Pool, on_join: Callable[[Backend], None], on_leave: Callable[[Backend], None]) -> None:
        self.pool = pool
        self._on_join = on_join
        self._on_leave = on_leave
        self._leaving: set[Backend] = set()
        self._reaper: asyncio.Task[None] | None = None

    def join(self, spec: BackendSpec, source: str) -> Backend:
        """Add a backend; raises ValueError when its URL or name is taken (except by a backend of the same source
        that is leaving: that one stays)."""
        present = self.pool.find(spec.url)
        if present is not None and present in self._leaving and present.source == source:
            self._leaving.discard(present)
            present.draining = False
            logger.info("backend %s is back (%s): it serves again", present.url, source)
            return present
        backend = self.pool.add(spec, source)
        logger.info("backend %s added (%s); it serves after its first good health check", backend.url, source)
        self._on_join(backend)
        return backend

    def drain(self, backend: Backend) -> None:
        self.pool.drain(backend)

    def leave(self, backend: Backend) -> None:
        """Drain `backend`, and remove it once its requests in flight have finished."""
        self.pool.drain(backend)
        self._leaving.add(backend)
        self.reap()

    def reap(self) -> None:
        for backend in [b for b in self._leaving if b.in_flight == 0]:
            self._leaving.discard(backend)
            self.pool.remove(backend)
            self._on_leave(backend)

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_every(REAP_INTERVAL_S))

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)

    async def _reap_every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.reap()


class Watch:
    """One source, asked every `interval_s`; what changed since its last answer is applied through `Membership`."""

    def __init__(self, source: Source, membership: Membership) -> None:
        self.source = source
        self.membership = membership
        self.known: set[str] = set()

    async def poll(self) -> None:
        found = await self.source.read()
        if found is None:
            return
        joined, left = diff(self.known, found)
        self.known = found
        for url in joined:
            self._join(url)
        for url in left:
            backend = self.membership.pool.find(url)
            if backend is not None and backend.source == self.source.name:
                logger.info("backend %s is gone from %s", url, self.source.name)
                self.membership.leave(backend)

    def _join(self, url: str) -> None:
        present = self.membership.pool.find(url)
        if present is not None and present.source != self.source.name:
            return  # configured or found elsewhere: that one owns it
        spec = BackendSpec(url, name=name_of(url))
        try:
            self.membership.join(spec, self.source.name)
        except ValueError:  # the name is another backend's: name it by its URL
            self.membership.join(BackendSpec(url, name=url), self.source.name)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.source.interval_s)
            try:
                await self.poll()
            except Exception:  # one bad round must not end the watch
                logger.exception("backend discovery through %s failed", self.source.name)


class Discovery:
    """The watches of the configured sources: a first answer of each before serving, then in the background."""

    def __init__(self, membership: Membership, sources: Sequence[Source]) -> None:
        self.watches = [Watch(source, membership) for source in sources]
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await asyncio.gather(*(watch.poll() for watch in self.watches))
        self._tasks = [asyncio.create_task(watch.run()) for watch in self.watches]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()


def sources(dns_names: Sequence[str], dns_interval_s: float, backend_file: str | None) -> list[Source]:
    found: list[Source] = [DnsSource(DnsName.parse(name), dns_interval_s) for name in dns_names]
    if backend_file is not None:
        found.append(FileSource(backend_file))
    return found
