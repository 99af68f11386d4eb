"""Where each client session key was served last: the evidence a key gives prefix_aware's cost.

A key (`x-session-id`, `prompt_cache_key`, `user`; see `gateway/api/prompts.py`) names requests the client
knows belong together. The router remembers, per key, the backend its last request went to and that request's
prompt by its length in blocks and the hash of its last block (`Visit`), so a later request can tell in one
comparison whether it continues that prompt (`Visit.continued_blocks`). The prefix index usually knows as
much; the key matters where it cannot: one request records at most a quarter of an index, so of a long context
the index keeps the head, which many conversations may share. A key never attracts a request that does not
continue what the backend was sent, so colliding or reused keys cost nothing.

The map is bounded in entries and in age (`gateway/expiring.py`): least recently used first out, and every entry
lives `ttl_s` after its key's last request. Keys are stored as 64-bit hashes, not as the client's strings. Each
gateway instance (and each `--workers` process) keeps its own map; with `--state` every visit is published with
the placements, so all instances learn each key (shared_state.py), except a visit replayed at start that is
already older than `ttl_s`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from gateway.expiring import ExpiringLru
from gateway.fleet.backends import Backend


def key_hash(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True, slots=True)  # a few 100k of them live in the session map
class Visit:
    """Where a session key's last request went: its backend; its prompt as the number of hashed blocks, the hash
    of the last one and how many of them the backend's index recorded (`PrefixIndex.record_limit_blocks`); and how
    many blocks that index had evicted then."""

    backend: Backend
    blocks: int
    last_hash: int
    recorded_blocks: int
    evicted_blocks: int

    @classmethod
    def of(cls, backend: Backend, blocks: int, last_hash: int) -> Visit:
        """A request of `blocks` hashed blocks (at least one) ending in `last_hash`, sent to `backend` and recorded
        in its index as far as one may be; its evictions counted from now."""
        index = backend.index
        return cls(backend, blocks, last_hash, min(blocks, index.record_limit_blocks), index.evicted_blocks)

    def continued_blocks(self, backend: Backend, hashes: Sequence[int]) -> int:
        """Blocks of the prompt `hashes` that `backend` computed for this visit: all of the visit's prompt when
        this one continues it (its last block hash is ours at the same place) and it went to `backend`, else 0."""
        if self.backend is not backend or not 0 < self.blocks <= len(hashes):
            return 0
        return self.blocks if hashes[self.blocks - 1] == self.last_hash else 0

    def pushed_out(self) -> int:
        """Blocks the backend's index evicted since the visit: newer content, which pushes this out in turn."""
        return self.backend.index.evicted_blocks - self.evicted_blocks


class Sessions(ExpiringLru[int, Visit]):
    def __init__(self, max_keys: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(max_keys, ttl_s, clock)

    def last_visit(self, key: int) -> Visit | None:
        """Where the key's last request went, None when unknown or expired."""
        return self.get(key)

    def visited(self, key: int, visit: Visit) -> None:
        self.put(key, visit)

    def visited_elsewhere(self, key: int, backend: Backend, blocks: int, last_hash: int, age_s: float) -> bool:
        """Another gateway instance sent the key's last request, of `blocks` blocks ending in `last_hash`, to
        `backend`, `age_s` ago (shared_state.py). False when that is older than the TTL (replayed at start):
        remembered now, it would live a whole TTL more."""
        if age_s >= self.ttl_s:
            return False
        # Eviction counts differ between instances: counted from now, a publication's delay late.
        self.put(key, Visit.of(backend, blocks, last_hash))
        return True
