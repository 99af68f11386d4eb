"""The distinct prompt blocks of the requests in flight on one backend: the KV memory they pin on the engine, where
a prefix shared by several running requests is held once (prefix_aware's `active_tokens` term).

The running prompts form a tree: a block's chained hash (`hashing.py`) names its whole prefix, so the block before
it in a prompt is its parent. A block is active while a request ends at it or one of the blocks right after it is
active, so the active blocks of any prompt are a leading run of it. Each active block keeps those two counts,
nothing is kept for the others, and a request touches only what it changes: one that starts finds where its
active run ends by bisection and adds the rest in one C-level update; one that ends walks back only as far as
blocks turn idle, or, when no other request runs under its first block, drops its whole prompt at once. So a
conversation's new turn behind a long history that other requests keep running costs its own few blocks, not
the history's hundreds, and a prompt alone costs little more than a dict update.
"""

from __future__ import annotations

from collections.abc import Sequence


class ActiveBlocks:
    def __init__(self) -> None:
        self._ending: dict[int, int] = {}     # active block -> requests whose prompt ends at it
        self._continued: dict[int, int] = {}  # active block -> active blocks right after it
        self._under_root: dict[int, int] = {}  # first block -> requests whose prompt starts with it
        self.count = 0

    def add(self, hashes: Sequence[int]) -> None:
        """A request with this prompt started."""
        if not hashes:
            return
        first, last = hashes[0], hashes[-1]
        ending, continued = self._ending, self._continued
        self._under_root[first] = self._under_root.get(first, 0) + 1
        if last in ending or last in continued:  # active already, and so is everything before it
            ending[last] = ending.get(last, 0) + 1
            return
        start = self._end_of_active_run(hashes)
        continued.update(dict.fromkeys(hashes[start:-1], 1))
        ending[last] = 1
        if start:  # the new run hangs below an active block (one a request may end at, continued by none)
            continued[hashes[start - 1]] = continued.get(hashes[start - 1], 0) + 1
        self.count += len(hashes) - start

    def release(self, hashes: Sequence[int]) -> None:
        """A request with this prompt (one that was added) ended."""
        if not hashes or not self._ending.get(hashes[-1]):
            return
        first, last = hashes[0], hashes[-1]
        ending, continued = self._ending, self._continued
        alone = self._under_root[first] == 1
        if alone:
            del self._under_root[first]
        else:
            self._under_root[first] -= 1
        ending[last] -= 1
        if ending[last]:
            return
        del ending[last]
        if last in continued:
            return
        if alone:  # nothing else runs under its first block: its whole prompt turns idle
            for block in hashes[:-1]:
                del continued[block]
            self.count -= len(hashes)
            return
        removed = 1
        for position in range(len(hashes) - 2, -1, -1):
            block = hashes[position]
            if continued[block] > 1:  # another active block continues it
                continued[block] -= 1
                break
            del continued[block]
            if block in ending:  # another request ends at it
                break
            removed += 1
        self.count -= removed

    def _end_of_active_run(self, hashes: Sequence[int]) -> int:
        """The first position of `hashes` whose block is idle (its last block is)."""
        ending, continued = self._ending, self._continued
        low, high = 0, len(hashes) - 1
        while low < high:
            middle = (low + high) // 2
            if hashes[middle] in continued or hashes[middle] in ending:
                low = middle + 1
            else:
                high = middle
        return low
