"""The distinct prompt blocks of the requests in flight on one backend: the KV memory they pin on the engine, where
a prefix shared by several running requests is held once (prefix_aware's `active_tokens` term).

The running prompts form a tree: a block's chained hash (`hashing.py`) names its whole prefix, so the block before
it in a prompt is its parent. A block is active while a request ends at it or one of the blocks right after it is
active; each active block keeps those two counts, and nothing is kept for the others. A request that starts
marks its last block and walks towards the root only until it meets an active block; one that ends walks back
only as far as blocks turn idle. So a request costs the blocks no other running request holds: a conversation's
new turn behind a long history that other requests keep running costs its own few blocks, not the history's
hundreds.
"""

from __future__ import annotations

from collections.abc import Sequence

_ENDING, _CONTINUED = 0, 1  # a block's counts: requests ending at it, active blocks right after it


class ActiveBlocks:
    def __init__(self) -> None:
        self._blocks: dict[int, list[int]] = {}  # active block -> its two counts
        self.count = 0

    def add(self, hashes: Sequence[int]) -> None:
        """A request with this prompt started."""
        if not hashes:
            return
        blocks = self._blocks
        last = blocks.get(hashes[-1])
        if last is not None:  # active already, and so is everything before it
            last[_ENDING] += 1
            return
        blocks[hashes[-1]] = [1, 0]
        added = 1
        for position in range(len(hashes) - 2, -1, -1):
            block = blocks.get(hashes[position])
            if block is not None:
                block[_CONTINUED] += 1
                break
            blocks[hashes[position]] = [0, 1]
            added += 1
        self.count += added

    def release(self, hashes: Sequence[int]) -> None:
        """A request with this prompt (one that was added) ended."""
        blocks = self._blocks
        last = blocks.get(hashes[-1]) if hashes else None
        if last is None:
            return
        last[_ENDING] -= 1
        if last[_ENDING] or last[_CONTINUED]:
            return
        del blocks[hashes[-1]]
        removed = 1
        for position in range(len(hashes) - 2, -1, -1):
            block = blocks[hashes[position]]
            block[_CONTINUED] -= 1
            if block[_ENDING] or block[_CONTINUED]:
                break
            del blocks[hashes[position]]
            removed += 1
        self.count -= removed
