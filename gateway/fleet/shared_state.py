"""Several gateway instances sharing one view of the fleet through Redis (`--state redis://HOST:PORT/DB`).

Never on the request path: every instance routes on its local state. What it changes there is published by
appending it, as it is, to a local queue (`Backend.publisher`); a background task encodes and flushes the queue
every `FLUSH_INTERVAL_S` in one pipelined round trip, and another applies what the other instances published.

- Index updates go through one Redis stream (`KEY_PREFIX + "index"`, trimmed to about `STREAM_MAXLEN` entries).
  An entry is one flush of one instance: its id, the wall time of its oldest update, and the updates packed
  back to back (`encode_*`): a placement is the backend's compact id and the prompt's block hashes, 8 bytes each;
  a correction (the backend evicted part of a prompt) the first forgotten block; a down verdict, and a restart
  seen (the backend's whole index cleared), nothing more.
  A prompt placed again on the backend it was last published for, within `REPLACEMENT_QUIET_S`, is not published
  again: all it would tell is that the prompt is still in use, which the others' LRU can learn that much later.
  A repeated prompt then costs the fleet one update a second, not one a request. Anything forgotten (a correction,
  a clear, a down verdict, published or applied) makes the next placement of every prompt news again.
  Backends are named by a 32-bit hash of their URL, so instances must list them under the same URLs.
  A new instance replays the stream before `start()` returns (bounded by `WARM_TIMEOUT_S`): its indexes hold
  the fleet's recent placements before it counts as ready.
- Load is state, not history: each instance writes its own counts per backend (in flight, prefilling, their
  remaining prefill tokens, active blocks) into one hash field with a sequence number, and reads the others'
  in the same round trip. Sums over the fresh ones (sequence moved within `LOAD_TTL_S`) land in
  `Backend.remote`, which the policies add to their own.
- A session key's last backend (`gateway/routing/sessions.py`) goes through the same stream: the key's 64-bit
  hash, the prompt's block count and last block hash: with the update's 7-byte header, 31 bytes. Every instance
  then knows where each key was served last, whichever instance served it; a visit replayed at start that is
  older than the session TTL is skipped.
- A backend one instance marks down is taken out by the others at once (its index cleared); their own health
  checks bring it back at their next good check. A verdict older than `DOWN_VERDICT_MAX_AGE_S` (replayed) only
  clears the index.

The store slow or gone: commands time out after `COMMAND_TIMEOUT_S`, the change is logged once, updates are
dropped (counted), the other instances' load expires, and retries back off up to `BACKOFF_MAX_S`. When the store
answers again, each instance republishes its whole index (`PrefixIndex.paths`), so all converge again.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import redis.asyncio as aioredis
import xxhash
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.fleet.backends import Backend, RemoteLoad
from gateway.fleet.pool import Pool

logger = logging.getLogger(__name__)

KEY_PREFIX = "prefix-gateway:"
FLUSH_INTERVAL_S = 0.05
REPLACEMENT_QUIET_S = 1.0  # a prompt placed again on the same backend is published at most this often
LOAD_TTL_S = 2.0  # another instance's load counts while its sequence moved this recently
FORGET_PEER_S = 60.0  # a load field this old belongs to a stopped instance and is deleted
STREAM_MAXLEN = 4096  # entries (flushes); with MAX_ENTRY_BYTES, bounds the stream below 256 MiB
MAX_ENTRY_BYTES = 64 * 1024
MAX_PENDING_BYTES = 4 * 1024 * 1024  # buffered while a flush is late; beyond, updates are dropped
READ_COUNT = 64
READ_BLOCK_MS = 500
COMMAND_TIMEOUT_S = 1.0  # a socket read longer than this counts as the store being down
WARM_TIMEOUT_S = 10.0
DOWN_VERDICT_MAX_AGE_S = 10.0
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.1, 5.0
DELAY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5)

PLACED, CORRECTED, DOWN, CLEARED, SESSION = 1, 2, 3, 4, 5
_FORGETTING = frozenset({CORRECTED, DOWN, CLEARED})
_HEADER = struct.Struct("<BIH")  # kind, backend id, number of hashes that follow
_MAX_HASHES = 0xFFFF  # a longer prompt keeps its head, as an index shorter than it does
_LOAD_HEAD = struct.Struct("<Q")  # sequence number
_LOAD_ENTRY = struct.Struct("<IIIII")  # backend id, in flight, prefilling, prefill tokens, active blocks


class SessionMap(Protocol):
    """Where session keys were served last (gateway/routing/sessions.py's `Sessions`)."""

    def visited_elsewhere(self, key: int, backend: Backend, blocks: int, last_hash: int, age_s: float) -> bool:
        """Another instance sent the key's last request to `backend` `age_s` ago; False when not remembered."""
        ...


# -- encoding ------------------------------------------------------------------------------------------------

def backend_id(url: str) -> int:
    return xxhash.xxh32_intdigest(url.encode("utf-8"))


def encode_update(kind: int, backend: int, hashes: Sequence[int] = ()) -> bytes:
    hashes = hashes[:_MAX_HASHES]
    return _HEADER.pack(kind, backend, len(hashes)) + struct.pack(f"<{len(hashes)}Q", *hashes)


def encoded_size(hashes: Sequence[int]) -> int:
    """`len(encode_update(kind, backend, hashes))`, without encoding them."""
    return _HEADER.size + 8 * min(len(hashes), _MAX_HASHES)


def decode_updates(blob: bytes) -> Iterator[tuple[int, int, tuple[int, ...]]]:
    """(kind, backend id, hashes) of each update packed in `blob`."""
    offset = 0
    while offset < len(blob):
        kind, backend, count = _HEADER.unpack_from(blob, offset)
        offset += _HEADER.size
        yield kind, backend, struct.unpack_from(f"<{count}Q", blob, offset)
        offset += 8 * count


def encode_load(sequence: int, loads: Sequence[tuple[int, RemoteLoad]]) -> bytes:
    entries = (_LOAD_ENTRY.pack(backend, load.in_flight, load.prefilling, load.prefill_tokens, load.active_blocks)
               for backend, load in loads)
    return _LOAD_HEAD.pack(sequence) + b"".join(entries)


def decode_load(blob: bytes) -> tuple[int, dict[int, RemoteLoad]]:
    (sequence,) = _LOAD_HEAD.unpack_from(blob)
    loads = {}
    for offset in range(_LOAD_HEAD.size, len(blob), _LOAD_ENTRY.size):
        backend, *counts = _LOAD_ENTRY.unpack_from(blob, offset)
        loads[backend] = RemoteLoad(*counts)
    return sequence, loads


def local_load(backend: Backend, now_s: float) -> RemoteLoad:
    """What this instance has on `backend`, as the others will see it."""
    return RemoteLoad(backend.in_flight, backend.prefilling, round(backend.backlog.remaining_tokens(now_s)),
                      backend.active_blocks)


def apply_update(backends: dict[int, Backend], kind: int, backend: int, hashes: Sequence[int], age_s: float,
                 sessions: SessionMap | None = None) -> bool:
    """Apply one update another instance published `age_s` ago; False when it names no backend of ours, or is of a
    kind this version does not know (or a session key, when this instance keeps none or it has expired)."""
    target = backends.get(backend)
    if target is None:
        return False
    if kind == SESSION:
        if sessions is None or len(hashes) != 3:
            return False
        key, blocks, last_hash = hashes
        return sessions.visited_elsewhere(key, target, blocks, last_hash, age_s)
    if kind == PLACED:
        target.index.insert(hashes)
    elif kind == CORRECTED:
        target.index.truncate(hashes, 0)
    elif kind == DOWN and age_s <= DOWN_VERDICT_MAX_AGE_S:
        target.take_out("another gateway instance marked it down")
    elif kind in (DOWN, CLEARED):  # an old down verdict, replayed, or a restart: its cache was lost then
        target.index.clear()
    else:  # a kind a newer version publishes
        return False
    return True


# -- the link to the store -----------------------------------------------------------------------------------

class _Link:
    """Whether the store answers: logs each change once, spaces retries out while it does not."""

    def __init__(self, shown_url: str, up_gauge: Gauge) -> None:
        self.shown_url = shown_url
        self.up = False
        self.error: str | None = None
        self.came_back = False  # set on each return after a failure; the flusher resynchronises and resets it
        self._gauge = up_gauge
        self._backoff_s = BACKOFF_MIN_S
        self._retry_at_s = 0.0

    def ok(self) -> None:
        if self.up:
            return
        if self.error is not None:
            logger.warning("state store %s answers again; resynchronising", self.shown_url)
            self.came_back = True
        self.up, self.error, self._backoff_s = True, None, BACKOFF_MIN_S
        self._gauge.set(1)

    def failed(self, exc: BaseException) -> None:
        if self.up or self.error is None:
            logger.warning("state store %s unreachable (%s: %s); routing on local state until it answers",
                           self.shown_url, exc.__class__.__name__, exc)
        self.up, self.error = False, f"{exc.__class__.__name__}: {exc}"
        self._gauge.set(0)
        self._retry_at_s = time.monotonic() + self._backoff_s
        self._backoff_s = min(BACKOFF_MAX_S, self._backoff_s * 2)

    def wait_s(self) -> float:
        """Seconds until the store may be tried again (0 while it answers)."""
        return 0.0 if self.up else max(0.0, self._retry_at_s - time.monotonic())


@dataclass
class _Peer:
    sequence: int
    changed_s: float  # time.monotonic() when its sequence last moved
    loads: dict[int, RemoteLoad]


class SharedState:
    """This instance's side of the shared view: the publisher of its backends and the applier of the others'."""

    def __init__(self, url: str, pool: Pool, registry: CollectorRegistry, instance: str | None = None,
                 sessions: SessionMap | None = None) -> None:
        self.instance = instance or secrets.token_hex(4)
        self._id = self.instance.encode()
        self._pool = pool
        self._sessions = sessions
        self._by_id: dict[int, Backend] = {}
        self._pool_version = -1  # of the pool `_by_id` was built from
        self._redis = aioredis.Redis.from_url(url, socket_timeout=COMMAND_TIMEOUT_S + READ_BLOCK_MS / 1000,
                                              socket_connect_timeout=COMMAND_TIMEOUT_S, retry=Retry(NoBackoff(), 0))
        self._stream, self._loads = KEY_PREFIX + "index", KEY_PREFIX + "load"
        parts = urlsplit(url)
        self._link = _Link(f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}{parts.path}",
                           Gauge("gateway_state_store_up", "1 while the shared state store answers",
                                 registry=registry))
        self._pending: list[tuple[int, str, Sequence[int]]] = []  # (kind, backend URL, hashes) of each update
        self._pending_bytes = 0
        self._oldest_s = 0.0  # wall time of the oldest pending update
        # (backend URL, last block) of the prompts published since `_quiet_since_s`: their placement again is no news
        self._published_recently: set[tuple[str, int]] = set()
        self._quiet_since_s = 0.0
        self._last_id = "0-0"
        self._sequence = 0
        self._peers: dict[bytes, _Peer] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._forget: list[str] = []  # load fields of stopped instances, deleted at the next flush
        self.warmed_updates: int | None = None  # None until the stream was replayed
        self.last_delay_s: float | None = None
        self._registry = registry
        self._published = Counter("gateway_state_published_updates", "Index updates sent to the state store",
                                  registry=registry)
        self._published_bytes = Counter("gateway_state_published_bytes", "Bytes of index updates sent to the "
                                        "state store (entry overhead excluded)", registry=registry)
        self._applied = Counter("gateway_state_applied_updates", "Index updates of other instances applied here",
                                registry=registry)
        self._dropped = Counter("gateway_state_dropped_updates", "Index updates not sent: the store was slow or "
                                "gone", registry=registry)
        self._delay = Histogram("gateway_state_apply_delay_seconds", "From an update's publication by another "
                                "instance to its application here (wall clocks)", buckets=DELAY_BUCKETS_S,
                                registry=registry)

    # -- publishing (Backend.publisher): appends only ---------------------------------------------------------

    def placed(self, backend: Backend, hashes: Sequence[int]) -> None:
        if not hashes:  # no full block: nothing to match
            return
        leaf = (backend.url, hashes[-1])
        if leaf in self._published_recently:
            return
        self._published_recently.add(leaf)
        self._append(PLACED, backend.url, hashes)

    def corrected(self, backend: Backend, hashes: Sequence[int], keep_blocks: int) -> None:
        self._append(CORRECTED, backend.url, hashes[keep_blocks:keep_blocks + 1])

    def marked_down(self, backend: Backend) -> None:
        self._append(DOWN, backend.url, ())

    def session_visited(self, backend: Backend, key: int, blocks: int, last_hash: int) -> None:
        self._append(SESSION, backend.url, (key, blocks, last_hash))

    def cleared(self, backend: Backend) -> None:
        self._append(CLEARED, backend.url, ())

    def _end_quiet_interval(self, now_s: float) -> None:
        """Once every REPLACEMENT_QUIET_S, each prompt's next placement is published again: the others' LRU learns
        that it is still in use."""
        if now_s - self._quiet_since_s >= REPLACEMENT_QUIET_S:
            self._published_recently.clear()
            self._quiet_since_s = now_s

    def _backends(self) -> dict[int, Backend]:
        """The pool's backends by compact id, rebuilt when backends joined or left (discovery, admin API)."""
        if self._pool_version != self._pool.version:
            self._by_id = {backend_id(b.url): b for b in self._pool.backends}
            self._pool_version = self._pool.version
        return self._by_id

    def _append(self, kind: int, url: str, hashes: Sequence[int]) -> None:
        """Queue an update as it is; the flush encodes the queue in one go, off the request's path. `hashes` are
        never changed once made, so holding them is enough."""
        if kind in _FORGETTING:  # what we placed may be gone from the others' indexes with it
            self._published_recently.clear()
        size = encoded_size(hashes)
        if self._pending_bytes + size > MAX_PENDING_BYTES:
            self._drop(1)
            return
        if not self._pending:
            self._oldest_s = time.time()
        self._pending.append((kind, url, hashes))
        self._pending_bytes += size

    # -- lifecycle --------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Replay the stream into the indexes (bounded), then share in the background."""
        self._pool.publisher = self  # for backends added later
        for backend in self._pool.backends:
            backend.publisher = self
        self.warmed_updates = await self._warm()
        self._tasks = [asyncio.create_task(self._flush_loop()), asyncio.create_task(self._read_loop())]

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # redis-py may turn the cancellation of a blocked read into a connection error, which the loops retry:
            # they end at their next turn instead (`_stopping`), within one read's timeout.
            await asyncio.wait(self._tasks, timeout=COMMAND_TIMEOUT_S + READ_BLOCK_MS / 1000 + 1)
        self._tasks.clear()
        await self._redis.aclose()

    def describe(self) -> dict[str, Any]:
        """For GET /ready: the store's state never makes the gateway unready."""
        now_s, registry = time.monotonic(), self._registry
        return {"store": self._link.shown_url, "up": self._link.up, "instance": self.instance,
                "warmed_updates": self.warmed_updates, "error": self._link.error,
                "peers": sum(1 for peer in self._peers.values() if now_s - peer.changed_s <= LOAD_TTL_S),
                **{f"{name}_updates": int(registry.get_sample_value(f"gateway_state_{name}_updates_total") or 0)
                   for name in ("published", "applied", "dropped")},
                "last_apply_delay_ms": None if self.last_delay_s is None else round(self.last_delay_s * 1000, 1)}

    # -- reading the stream -----------------------------------------------------------------------------------

    async def _warm(self) -> int | None:
        """Apply what the stream holds, up to WARM_TIMEOUT_S; the number of updates, None if the store failed."""
        deadline_s, total = time.monotonic() + WARM_TIMEOUT_S, 0
        while time.monotonic() < deadline_s:
            try:
                entries = await self._read(block_ms=None)
            except (RedisError, OSError) as exc:
                self._link.failed(exc)
                return None
            self._link.ok()
            total += await self._apply_entries(entries, live=False)
            if len(entries) < READ_COUNT:
                logger.info("state store %s: %d updates of other instances replayed", self._link.shown_url, total)
                return total
        logger.warning("state store %s: stream replay stopped after %.0f s; the rest arrives live",
                       self._link.shown_url, WARM_TIMEOUT_S)
        return total

    async def _read_loop(self) -> None:
        while not self._stopping:
            if self._link.wait_s() > 0:  # polled, so that reading resumes as soon as the flusher got through
                await asyncio.sleep(FLUSH_INTERVAL_S)
                continue
            try:
                entries = await self._read(block_ms=READ_BLOCK_MS)
            except (RedisError, OSError) as exc:
                self._link.failed(exc)
                continue
            self._link.ok()
            try:
                await self._apply_entries(entries, live=True)
            except Exception:  # one bad entry must not end the sharing
                logger.exception("applying the state store's updates failed")

    async def _read(self, block_ms: int | None) -> list[tuple[bytes, dict[bytes, bytes]]]:
        # RESP2's shape, [[stream, [(id, fields), ...]]]: redis-py's default protocol
        found: Any = await self._redis.xread({self._stream: self._last_id}, count=READ_COUNT, block=block_ms)
        return list(found[0][1]) if found else []

    async def _apply_entries(self, entries: list[tuple[bytes, dict[bytes, bytes]]], live: bool) -> int:
        applied = 0
        for entry_id, fields in entries:
            self._last_id = entry_id.decode()
            if fields.get(b"i") == self._id:
                continue
            try:
                age_s = max(0.0, time.time() - float(fields[b"t"]))
                for kind, backend, hashes in decode_updates(fields[b"b"]):
                    applied += apply_update(self._backends(), kind, backend, hashes, age_s, self._sessions)
                    if kind in _FORGETTING:  # as when we publish one (`_append`)
                        self._published_recently.clear()
            except (KeyError, ValueError, struct.error) as exc:  # not ours: another program's, or a newer format
                logger.debug("state store entry %s skipped: %r", self._last_id, exc)
                continue
            if live:
                self._delay.observe(age_s)
                self.last_delay_s = age_s
            await asyncio.sleep(0)  # a long catch-up must not hold requests up
        self._applied.inc(applied)
        return applied

    # -- flushing: updates out, load both ways ----------------------------------------------------------------

    async def _flush_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            self._end_quiet_interval(time.monotonic())
            if self._link.wait_s() > 0:
                continue  # the buffer waits for the next try, bounded by MAX_PENDING_BYTES
            if self._link.came_back:
                self._link.came_back = False
                self._republish()
            try:
                await self._flush()
            except Exception:  # a bad load field must not end the sharing
                logger.exception("exchanging with the state store failed")

    async def _flush(self) -> None:
        updates, oldest_s = self._take_pending()
        self._sequence += 1
        now_s = time.monotonic()
        mine = encode_load(self._sequence, [(bid, local_load(b, now_s)) for bid, b in self._backends().items()])
        pipe = self._redis.pipeline(transaction=False)
        for entry in _entries(updates):
            pipe.xadd(self._stream, {"i": self._id, "t": repr(oldest_s), "b": entry}, maxlen=STREAM_MAXLEN,
                      approximate=True)
        pipe.hset(self._loads, self.instance, mine)
        if self._forget:
            pipe.hdel(self._loads, *self._forget)
            self._forget = []
        pipe.hgetall(self._loads)
        try:
            replies = await pipe.execute()
        except (RedisError, OSError) as exc:
            self._link.failed(exc)
            self._drop(len(updates))
            self._expire_peers(now_s)
            return
        self._link.ok()
        self._published.inc(len(updates))
        self._published_bytes.inc(sum(map(len, updates)))
        self._apply_loads(replies[-1], now_s)

    def _drop(self, updates: int) -> None:
        self._dropped.inc(updates)

    def _take_pending(self) -> tuple[list[bytes], float]:
        """The queued updates, encoded, and the wall time of the oldest."""
        pending, oldest_s = self._pending, self._oldest_s
        self._pending, self._pending_bytes = [], 0
        return [encode_update(kind, backend_id(url), hashes) for kind, url, hashes in pending], oldest_s

    def _apply_loads(self, fields: dict[bytes, bytes], now_s: float) -> None:
        for instance, blob in fields.items():
            if instance == self._id:
                continue
            sequence, loads = decode_load(blob)
            peer = self._peers.get(instance)
            if peer is None or peer.sequence != sequence:
                self._peers[instance] = _Peer(sequence, now_s, loads)
            elif now_s - peer.changed_s > FORGET_PEER_S:
                self._forget.append(instance.decode())
                del self._peers[instance]
        self._expire_peers(now_s)

    def _expire_peers(self, now_s: float) -> None:
        """Sum the fresh peers' loads into each backend's remote share; stale peers count for nothing."""
        totals: dict[int, RemoteLoad] = {}
        for peer in self._peers.values():
            if now_s - peer.changed_s <= LOAD_TTL_S:
                for bid, load in peer.loads.items():
                    totals[bid] = totals.get(bid, RemoteLoad()) + load
        for bid, backend in self._backends().items():
            backend.remote = totals.get(bid, RemoteLoad())

    def _republish(self) -> None:
        """Queue this instance's whole index: what others missed while the store was gone (or empty)."""
        for backend in self._backends().values():
            for path in backend.index.paths():
                self._append(PLACED, backend.url, path)


def _entries(updates: list[bytes]) -> Iterator[bytes]:
    """The updates joined into stream entries of at most MAX_ENTRY_BYTES (an oversized update alone)."""
    chunk: list[bytes] = []
    size = 0
    for update in updates:
        if chunk and size + len(update) > MAX_ENTRY_BYTES:
            yield b"".join(chunk)
            chunk, size = [], 0
        chunk.append(update)
        size += len(update)
    if chunk:
        yield b"".join(chunk)


class LocalState:
    """The shared state of a gateway that shares nothing (no `--state`)."""

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"store": None}


def shared_state(url: str | None, pool: Pool, registry: CollectorRegistry,
                 sessions: SessionMap | None = None) -> SharedState | LocalState:
    return LocalState() if url is None else SharedState(url, pool, registry, sessions=sessions)
