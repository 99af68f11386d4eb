"""The gateway's model of one backend's prefix cache: a radix tree over chained block hashes, LRU-bounded.

Each node is one block of some cached prompt; its key is the block's chained hash (see `hashing.py`), so the
key names the whole path from the root and the tree can be stored as dicts keyed by block with parent links:
matching a prompt is one dict probe per block, and two prompts that diverge inside a block simply have
different children. Unlike a character-level radix tree there is nothing to split. The dicts hold ints only,
which Python's garbage collector does not track: with an object per block, a full collection over an index of
800,000 blocks stalled the event loop for ~100 ms, and an index may hold a million.

Bounded like the engine's own cache: at most `capacity_blocks` nodes. When an insert would exceed it, the least
recently used *leaf* goes first, as in SGLang's radix cache. A node's recency is the last use of any prompt
through it, so a prefix is never older than what continues it, and evicting leaves in LRU order keeps each
prefix's first blocks longest: the shared system prompt outlives the conversations hanging off it. Only leaves
are ever compared, so a use marks just the prompt's last block, and a block that leaves hands its recency to
its parent: an insert costs the blocks it adds and a bisection, not a walk over a long prompt's every block.
The leaves are kept in a sorted list, which pays for each use as it comes. A heap that leaves a used leaf's old
entry behind would make a use cheaper, but its stale entries pile up until the heap is rebuilt: a pause of the
event loop that grows with the number of leaves.

Nothing here awaits, so the event loop needs no locks around it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from sortedcontainers import SortedList

# The most of an index one request may record. A giant prompt (30 MB, say, and rejected at that) would otherwise
# evict every conversation the index knows of; its head is kept, which is what later requests match.
MAX_RECORD_SHARE = 0.25


_NO_PARENT = -1  # the parent of a prompt's first block: block hashes are unsigned, so no block is -1
# A block's creation and last use as one int, created << _TIME_BITS | last use: a dict of them stays untracked,
# and the blocks a prompt adds at once share one. Clock ticks stay far below 2**64.
_TIME_BITS = 64
_LAST_USE = (1 << _TIME_BITS) - 1
_CREATED = ~_LAST_USE


class PrefixIndex:
    """Which prompt prefixes one backend probably holds, in blocks."""

    def __init__(self, capacity_blocks: int, clock: Callable[[], int] | None = None) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self._capacity = capacity_blocks
        # One clock shared by all backends' indexes makes `created_at` comparable across them.
        self._clock = clock or itertools.count(1).__next__
        self._parent: dict[int, int] = {}  # block -> the block before it (_NO_PARENT for a prompt's first)
        # A prompt's blocks form a chain, so most blocks have one child: `_child` holds it (a leaf has none), and
        # a set of the others is made only where prompts branch.
        self._child: dict[int, int] = {}
        self._more_children: dict[int, set[int]] = {}
        self._times: dict[int, int] = {}  # block -> its creation and last use (`_TIME_BITS`)
        self._leaves: SortedList = SortedList()  # (last use, block) of blocks without children
        self.evicted_blocks = 0  # blocks pushed out by the LRU bound so far: how much newer content came in

    @property
    def size_blocks(self) -> int:
        return len(self._parent)

    @property
    def capacity_blocks(self) -> int:
        return self._capacity

    @capacity_blocks.setter
    def capacity_blocks(self, blocks: int) -> None:
        self._capacity = max(1, blocks)
        self._evict_down_to(self._capacity)

    @property
    def record_limit_blocks(self) -> int:
        """The most leading blocks of one prompt that one request may record (`MAX_RECORD_SHARE`), at least 1."""
        return max(1, int(self._capacity * MAX_RECORD_SHARE))

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of `hashes` present; does not count as a use.

        The blocks present are always a leading run of `hashes`: a block's chained hash names its whole prefix,
        and the index never holds a block without its parent (it evicts leaves and forgets whole subtrees). So
        the end of the run is found by bisection, a few dict probes for a prompt of hundreds of blocks."""
        blocks = self._parent
        low, high = 0, len(hashes)  # hashes[:low] are present, hashes[high:] are not
        while low < high:
            middle = (low + high) // 2
            if hashes[middle] in blocks:
                low = middle + 1
            else:
                high = middle
        return low

    def is_leaf(self, key: int) -> bool:
        """Whether block `key` is cached and no cached prompt continues past it."""
        return key in self._parent and key not in self._child

    def created_at(self, key: int) -> int:
        """Clock value at which the block `key` was first inserted (0 when absent)."""
        times = self._times.get(key)
        return times >> _TIME_BITS if times is not None else 0

    def insert(self, hashes: Sequence[int]) -> None:
        """Record that the backend now caches this prompt: add the blocks it lacks, mark the prompt used."""
        hashes = hashes[: self._capacity]  # a prompt longer than the cache keeps its head, like the engine
        if not hashes:
            return
        tick = self._clock()
        present = self.match(hashes)
        if present == len(hashes):
            self._touch(hashes[-1], tick)
        else:
            self._add_chain(hashes[present - 1] if present else _NO_PARENT, hashes[present:], tick)
        self._evict_down_to(self._capacity)

    def truncate(self, hashes: Sequence[int], keep_blocks: int) -> int:
        """Forget this prompt's blocks from `keep_blocks` on, with all that hangs below them.

        Used when the backend reports fewer cached tokens than the index predicted: it evicted that part.
        Returns the number of nodes removed.
        """
        if keep_blocks >= len(hashes) or hashes[keep_blocks] not in self._parent:
            return 0
        return self._remove_subtree(hashes[keep_blocks])

    def paths(self) -> list[list[int]]:
        """Every cached prompt as its root-to-leaf hashes, least recently used first: inserted in this order into
        another index they rebuild this one's content and LRU order (shared_state.py's resynchronisation)."""
        paths = []
        for _, key in self._leaves:
            path = []
            while key != _NO_PARENT:
                path.append(key)
                key = self._parent[key]
            path.reverse()
            paths.append(path)
        return paths

    def clear(self) -> None:
        for table in (self._parent, self._child, self._more_children, self._times):
            table.clear()
        self._leaves.clear()

    def _children(self, key: int) -> list[int]:
        child = self._child.get(key)
        if child is None:
            return []
        return [child, *self._more_children.get(key, ())]

    def _leaf_entry(self, key: int) -> tuple[int, int]:
        """Block `key` as the leaf list orders it: (last use, block)."""
        return self._times[key] & _LAST_USE, key

    def _add_chain(self, parent: int, keys: Sequence[int], tick: int) -> None:
        """Hang `keys` below `parent` (_NO_PARENT: as a new root) one after the other. Only the last is a leaf, so
        the leaf list changes once for the chain, not twice a block: a conversation's turn adds tens of blocks."""
        if parent != _NO_PARENT:
            if parent not in self._child:  # a leaf until now
                self._leaves.remove(self._leaf_entry(parent))
                self._child[parent] = keys[0]
            else:
                self._more_children.setdefault(parent, set()).add(keys[0])
        parents, children, times = self._parent, self._child, self._times
        created = tick << _TIME_BITS | tick
        previous = parent
        for key in keys:
            parents[key] = previous
            times[key] = created
            if previous != parent:
                children[previous] = key
            previous = key
        self._leaves.add((tick, previous))

    def _touch(self, key: int, tick: int) -> None:
        times = self._times[key]
        if key not in self._child:
            self._leaves.remove((times & _LAST_USE, key))
            self._leaves.add((tick, key))
        self._times[key] = times & _CREATED | tick

    def _evict_down_to(self, capacity: int) -> None:
        """Evict least recently used leaves down to `capacity` blocks. A parent left without children that is
        older than every listed leaf would be the next one out: it goes at once, without entering the leaf
        list, so an old prompt leaves in one walk up its chain."""
        blocks, leaves = self._parent, self._leaves
        while len(blocks) > capacity:
            _, key = leaves.pop(0)
            next_out = leaves[0] if leaves else None  # the walk below leaves the list as it is
            parent = self._unlink(key)
            self.evicted_blocks += 1
            while parent != _NO_PARENT:
                entry = self._leaf_entry(parent)
                if len(blocks) <= capacity or (next_out is not None and next_out < entry):
                    leaves.add(entry)
                    break
                parent = self._unlink(parent)
                self.evicted_blocks += 1

    def _remove_leaf(self, key: int) -> None:
        self._leaves.remove(self._leaf_entry(key))
        parent = self._unlink(key)
        if parent != _NO_PARENT:
            self._leaves.add(self._leaf_entry(parent))

    def _unlink(self, key: int) -> int:
        """Forget leaf `key`, which the leaf list no longer holds; its parent when that is now a leaf (and not
        listed yet), else _NO_PARENT."""
        parent = self._parent.pop(key)
        last_use = self._times.pop(key) & _LAST_USE
        if parent == _NO_PARENT:
            return _NO_PARENT
        self._drop_child(parent, key)
        times = self._times[parent]
        if last_use > times & _LAST_USE:  # its prefix was used that recently
            self._times[parent] = times & _CREATED | last_use
        return parent if parent not in self._child else _NO_PARENT

    def _drop_child(self, parent: int, key: int) -> None:
        more = self._more_children.get(parent)
        if self._child[parent] == key:
            if more:
                self._child[parent] = more.pop()
            else:
                del self._child[parent]
        elif more is not None:
            more.discard(key)
        if more is not None and not more:
            del self._more_children[parent]

    def _remove_subtree(self, top: int) -> int:
        order: list[int] = []
        stack = [top]
        while stack:  # collect depth-first, then remove children before parents so each is a leaf
            key = stack.pop()
            order.append(key)
            stack.extend(self._children(key))
        for key in reversed(order):
            self._remove_leaf(key)
        return len(order)

    def check_invariants(self) -> None:
        """Recount everything kept incrementally; raises AssertionError on any mismatch (for tests)."""
        assert len(self._parent) <= self._capacity, "over capacity"
        assert self._times.keys() == self._parent.keys(), "times out of date"
        assert self._child.keys() <= self._parent.keys(), "children of a forgotten block"
        for key, parent in self._parent.items():
            if parent != _NO_PARENT:
                assert parent in self._parent, "orphan block"
                assert key in self._children(parent)
            for child in self._children(key):
                assert self._parent[child] == key
        assert all(more and parent in self._child for parent, more in self._more_children.items()), "loose children"
        leaves = {self._leaf_entry(key) for key in self._parent if key not in self._child}
        assert leaves == set(self._leaves), "leaf set out of date"
