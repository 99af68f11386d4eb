"""A map bounded in entries and in age, for what the gateway remembers per client-chosen key.

`put` makes a key the newest; beyond `max_entries` the least recently put key leaves first, and every entry
leaves `ttl_s` after its last put (a read does not refresh it). Every entry lives the same `ttl_s`, so the front
is always the oldest and expiry is a pop from the left: O(1) amortised per operation, no timers.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ExpiringLru(Generic[K, V]):
    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: collections.OrderedDict[K, tuple[V, float]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> V | None:
        """The value last put under `key`, None when unknown or older than `ttl_s`."""
        found = self._entries.get(key)
        if found is None:
            return None
        now = self._clock()
        if now - found[1] >= self.ttl_s:
            self._expire(now)  # everything in front of it is older still
            return None
        return found[0]

    def put(self, key: K, value: V) -> None:
        now = self._clock()
        self._entries.pop(key, None)
        self._entries[key] = (value, now)
        self._expire(now)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def pop(self, key: K) -> None:
        self._entries.pop(key, None)

    def _expire(self, now: float) -> None:
        while self._entries:
            _, (_, at) = next(iter(self._entries.items()))
            if now - at < self.ttl_s:
                return
            self._entries.popitem(last=False)
