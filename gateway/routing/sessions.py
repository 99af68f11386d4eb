"""Where each client session key was served last: the evidence a key gives prefix_aware's cost.

A key (`x-session-id`, `prompt_cache_key`, `user`; see `gateway/api/prompts.py`) names requests the client
knows belong together. The router remembers, per key, the backend its last request went to and that request's
prompt by its length in blocks and the hash of its last block (`Visit`), so a later request can tell in one
comparison whether it continues that prompt (`RoutingRequest.session_blocks`). The prefix index usually knows as
much; the key matters where it cannot: one request records at most a quarter of an index, so of a long context
the index keeps the head, which many conversations may share. A key never attracts a request that does not
continue what the backend was sent, so colliding or reused keys cost nothing.

The map is bounded in entries and in age: least recently used first out, and every entry lives `ttl_s` after its
key's last request (so the front is always the oldest and expiry pops from the left). Keys are stored as 64-bit
hashes, not as the client's strings. Each gateway instance (and each `--workers` process) keeps its own map; with
`--state` every visit is published with the placements, so all instances learn each key (shared_state.py).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import xxhash

from gateway.routing.policies import Visit


def key_hash(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogatepass"))


class Sessions:
    def __init__(self, max_keys: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_keys = max_keys
        self.ttl_s = ttl_s
        self._clock = clock
        self._visits: collections.OrderedDict[int, tuple[Visit, float]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._visits)

    def last_visit(self, key: int) -> Visit | None:
        """Where the key's last request went, None when unknown or expired."""
        found = self._visits.get(key)
        if found is None:
            return None
        if self._clock() - found[1] >= self.ttl_s:
            del self._visits[key]
            return None
        return found[0]

    def visited(self, key: int, visit: Visit) -> None:
        now = self._clock()
        self._visits.pop(key, None)
        self._visits[key] = (visit, now)
        self._expire(now)
        while len(self._visits) > self.max_keys:
            self._visits.popitem(last=False)

    def _expire(self, now: float) -> None:
        while self._visits:
            _, (_, at) = next(iter(self._visits.items()))
            if now - at < self.ttl_s:
                return
            self._visits.popitem(last=False)
