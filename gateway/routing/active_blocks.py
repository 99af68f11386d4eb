"""The distinct prompt blocks of the requests in flight on one backend: the KV memory they pin on the engine, where
a prefix shared by several running requests is held once (prefix_aware's `active_tokens` term).

Each block's number of requests through it is `added - released`, two counters that a request's whole prompt
updates at C speed. Along a prompt's chained hashes (`hashing.py`) that number never grows: every request through
a block passes through its parent too. So the blocks one request makes active, or idle when it ends, are a suffix
of its prompt, found by bisection, and only they are touched one by one: a conversation's new turn behind a long
shared history costs its own few blocks, not the history's hundreds.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence


class ActiveBlocks:
    def __init__(self) -> None:
        self._added: collections.Counter[int] = collections.Counter()
        self._released: collections.Counter[int] = collections.Counter()
        self.count = 0  # blocks with at least one request through them

    def add(self, hashes: Sequence[int]) -> None:
        """A request with this prompt started."""
        self._added.update(hashes)
        self.count += len(hashes) - self._first_below(hashes, 2)  # its blocks no other request runs through

    def release(self, hashes: Sequence[int]) -> None:
        """A request with this prompt (one that was added) ended."""
        self._released.update(hashes)
        idle = self._first_below(hashes, 1)
        self.count -= len(hashes) - idle
        added, released = self._added, self._released
        for block in hashes[idle:]:
            added.pop(block, None)
            released.pop(block, None)

    def _first_below(self, hashes: Sequence[int], requests: int) -> int:
        """The first position of `hashes` whose block fewer than `requests` requests run through."""
        added, released = self._added, self._released
        low, high = 0, len(hashes)
        while low < high:
            middle = (low + high) // 2
            block = hashes[middle]
            if added[block] - released[block] >= requests:
                low = middle + 1
            else:
                high = middle
        return low
