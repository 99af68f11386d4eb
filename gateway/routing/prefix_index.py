"""The gateway's model of one backend's prefix cache: a radix tree over chained block hashes, LRU-bounded.

Each node is one block of some cached prompt; its key is the block's chained hash (see `hashing.py`), so the
key names the whole path from the root and the tree can be stored as a dict of nodes with parent links:
matching a prompt is one dict probe per block, and two prompts that diverge inside a block simply have
different children. Unlike a character-level radix tree there is nothing to split.

Bounded like the engine's own cache: at most `capacity_blocks` nodes. When an insert would exceed it, the least
recently used *leaf* goes first, as in SGLang's radix cache. A node's recency is the last use of any prompt
through it, so a prefix is never older than what continues it, and evicting leaves in LRU order keeps each
prefix's first blocks longest: the shared system prompt outlives the conversations hanging off it. Only leaves
are ever compared, so a use marks just the prompt's last block, and a block that leaves hands its recency to
its parent: an insert costs the blocks it adds and a bisection, not a walk over a long prompt's every block.

Nothing here awaits, so the event loop needs no locks around it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from sortedcontainers import SortedList

# The most of an index one request may record. A giant prompt (30 MB, say, and rejected at that) would otherwise
# evict every conversation the index knows of; its head is kept, which is what later requests match.
MAX_RECORD_SHARE = 0.25


class _Node:
    __slots__ = ("key", "parent", "child", "more_children", "last_access", "created")

    def __init__(self, key: int, parent: _Node | None, tick: int) -> None:
        self.key = key
        self.parent = parent
        # A prompt's blocks form a chain, so most nodes have one child: it is kept inline, and a set is made only
        # where prompts branch. A set per node (216 bytes even empty) was two thirds of a block's ~330 bytes.
        self.child: int | None = None  # None: a leaf (and then `more_children` is None too)
        self.more_children: set[int] | None = None
        self.last_access = tick
        self.created = tick

    def children(self) -> list[int]:
        if self.child is None:
            return []
        return [self.child] if self.more_children is None else [self.child, *self.more_children]

    def add_child(self, key: int) -> None:
        if self.child is None:
            self.child = key
        elif self.more_children is None:
            self.more_children = {key}
        else:
            self.more_children.add(key)

    def remove_child(self, key: int) -> None:
        if self.child == key:
            self.child = self.more_children.pop() if self.more_children else None
        elif self.more_children is not None:
            self.more_children.discard(key)
        if not self.more_children:
            self.more_children = None


class PrefixIndex:
    """Which prompt prefixes one backend probably holds, in blocks."""

    def __init__(self, capacity_blocks: int, clock: Callable[[], int] | None = None) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self._capacity = capacity_blocks
        # One clock shared by all backends' indexes makes `created_at` comparable across them.
        self._clock = clock or itertools.count(1).__next__
        self._nodes: dict[int, _Node] = {}
        self._roots: set[int] = set()
        self._leaves: SortedList = SortedList()  # (last_access, key) of nodes without children
        self.evicted_blocks = 0  # blocks pushed out by the LRU bound so far: how much newer content came in

    @property
    def size_blocks(self) -> int:
        return len(self._nodes)

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
        nodes = self._nodes
        low, high = 0, len(hashes)  # hashes[:low] are present, hashes[high:] are not
        while low < high:
            middle = (low + high) // 2
            if hashes[middle] in nodes:
                low = middle + 1
            else:
                high = middle
        return low

    def is_leaf(self, key: int) -> bool:
        """Whether block `key` is cached and no cached prompt continues past it."""
        node = self._nodes.get(key)
        return node is not None and node.child is None

    def created_at(self, key: int) -> int:
        """Clock value at which the block `key` was first inserted (0 when absent)."""
        node = self._nodes.get(key)
        return node.created if node else 0

    def insert(self, hashes: Sequence[int]) -> None:
        """Record that the backend now caches this prompt: add the blocks it lacks, mark the prompt used."""
        hashes = hashes[: self._capacity]  # a prompt longer than the cache keeps its head, like the engine
        if not hashes:
            return
        tick = self._clock()
        present = self.match(hashes)
        if present == len(hashes):
            self._touch(self._nodes[hashes[-1]], tick)
        else:
            self._add_chain(self._nodes[hashes[present - 1]] if present else None, hashes[present:], tick)
        self._evict_down_to(self._capacity)

    def truncate(self, hashes: Sequence[int], keep_blocks: int) -> int:
        """Forget this prompt's blocks from `keep_blocks` on, with all that hangs below them.

        Used when the backend reports fewer cached tokens than the index predicted: it evicted that part.
        Returns the number of nodes removed.
        """
        if keep_blocks >= len(hashes) or hashes[keep_blocks] not in self._nodes:
            return 0
        return self._remove_subtree(self._nodes[hashes[keep_blocks]])

    def paths(self) -> list[list[int]]:
        """Every cached prompt as its root-to-leaf hashes, least recently used first: inserted in this order into
        another index they rebuild this one's content and LRU order (shared_state.py's resynchronisation)."""
        paths = []
        for _, key in self._leaves:
            path = []
            node: _Node | None = self._nodes[key]
            while node is not None:
                path.append(node.key)
                node = node.parent
            path.reverse()
            paths.append(path)
        return paths

    def clear(self) -> None:
        self._nodes.clear()
        self._roots.clear()
        self._leaves.clear()

    def _add_chain(self, parent: _Node | None, keys: Sequence[int], tick: int) -> None:
        """Hang `keys` below `parent` (None: as a new root) one after the other. Only the last is a leaf, so the
        leaf list changes once for the chain, not twice a block: a conversation's turn adds tens of blocks."""
        if parent is None:
            self._roots.add(keys[0])
        elif parent.child is None:
            self._leaves.remove((parent.last_access, parent.key))
        nodes = self._nodes
        for key in keys:
            node = nodes[key] = _Node(key, parent, tick)
            if parent is not None:
                parent.add_child(key)
            parent = node
        self._leaves.add((tick, keys[-1]))

    def _touch(self, node: _Node, tick: int) -> None:
        if node.child is None:
            self._leaves.remove((node.last_access, node.key))
            self._leaves.add((tick, node.key))
        node.last_access = tick

    def _evict_down_to(self, capacity: int) -> None:
        """Evict least recently used leaves down to `capacity` nodes. A parent left without children that is
        older than every listed leaf would be the next one out: it goes at once, without entering the leaf
        list, so an old prompt leaves in one walk up its chain."""
        nodes, leaves = self._nodes, self._leaves
        while len(nodes) > capacity:
            _, key = leaves.pop(0)
            parent = self._unlink(nodes[key])
            self.evicted_blocks += 1
            while parent is not None:
                entry = (parent.last_access, parent.key)
                if len(nodes) <= capacity or (leaves and leaves[0] < entry):
                    leaves.add(entry)
                    break
                parent = self._unlink(parent)
                self.evicted_blocks += 1

    def _remove_leaf(self, node: _Node) -> None:
        self._leaves.remove((node.last_access, node.key))
        parent = self._unlink(node)
        if parent is not None:
            self._leaves.add((parent.last_access, parent.key))

    def _unlink(self, node: _Node) -> _Node | None:
        """Forget leaf `node`, which the leaf list no longer holds; its parent when that is now a leaf (and not
        listed yet), else None."""
        del self._nodes[node.key]
        parent = node.parent
        if parent is None:
            self._roots.discard(node.key)
            return None
        parent.remove_child(node.key)
        parent.last_access = max(parent.last_access, node.last_access)  # its prefix was used that recently
        return parent if parent.child is None else None

    def _remove_subtree(self, top: _Node) -> int:
        removed = 0
        stack = [top]
        order: list[_Node] = []
        while stack:  # collect depth-first, then remove children before parents so each is a leaf
            node = stack.pop()
            order.append(node)
            stack.extend(self._nodes[key] for key in node.children())
        for node in reversed(order):
            self._remove_leaf(node)
            removed += 1
        return removed

    def check_invariants(self) -> None:
        """Recount everything kept incrementally; raises AssertionError on any mismatch (for tests)."""
        assert len(self._nodes) <= self._capacity, "over capacity"
        leaves = set()
        for key, node in self._nodes.items():
            assert node.key == key
            if node.parent is None:
                assert key in self._roots, "root not registered"
            else:
                assert self._nodes.get(node.parent.key) is node.parent, "orphan node"
                assert key in node.parent.children()
            for child in node.children():
                assert self._nodes[child].parent is node
            assert node.more_children is None or (node.child is not None and node.more_children), "loose children"
            if node.child is None:
                leaves.add((node.last_access, key))
        assert leaves == set(self._leaves), "leaf set out of date"
        assert self._roots == {k for k, n in self._nodes.items() if n.parent is None}
