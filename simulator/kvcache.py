"""Block-level prefix cache over token ids, the way an engine's KV pool reuses computed prefixes.

The token sequence is cut into fixed blocks; a block is identified by (its parent block, its own tokens), so
one identity names a whole prefix, like the chained block hashes of vLLM and SGLang. Keys are the exact
(parent id, token tuple) pairs rather than hashes of them, so two different prefixes can never collide.

Only full blocks are cached: a prompt's trailing partial block is always recomputed.

Eviction removes least-recently-used *leaves* only. Every lookup or insert touches the whole path, so a parent
is never older than its children, and a prefix loses its last blocks first and its first blocks last -- the
order of SGLang's radix cache. Leaves wait in a heap keyed by last access; entries made stale by a later touch
are skipped when popped (lazy deletion) and the heap is rebuilt when stale entries dominate.

Each LoRA adapter has its own root (`namespace`, a negative id; 0 is the base model's): a block's identity
then includes the adapter, as vLLM's block hashes include the adapter's name, so the same tokens under two
adapters are two cache entries.

A running request pins its prefix with `lock()` (SGLang's lock_ref): locked blocks are never evicted, and the
engine counts them against the pool. The load-test oracle never locks.

Pure and synchronous: the engine and the load-test oracle both drive it; it never does I/O.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

_ROOT_ID = 0


class _Block:
    __slots__ = ("key", "node_id", "parent", "children", "last_access", "locks")

    def __init__(self, key: tuple[int, tuple[int, ...]], node_id: int, parent: _Block | None, now: int) -> None:
        self.key = key
        self.node_id = node_id
        self.parent = parent
        self.children = 0
        self.last_access = now
        self.locks = 0


@dataclass(frozen=True)
class LockedPrefix:
    """What `PrefixKVCache.lock` pinned; hand it back to `unlock`."""

    blocks: tuple[_Block, ...]
    tokens: int


class PrefixKVCache:
    def __init__(self, capacity_tokens: int, block_tokens: int = 16) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self.block_tokens = block_tokens
        self._blocks: dict[tuple[int, tuple[int, ...]], _Block] = {}
        self._leaf_heap: list[tuple[int, int, _Block]] = []
        self._clock = 0      # logical time: deterministic, and ties cannot happen
        self._locked_blocks = 0
        self._next_id = 1

    @property
    def used_tokens(self) -> int:
        return len(self._blocks) * self.block_tokens

    @property
    def locked_tokens(self) -> int:
        return self._locked_blocks * self.block_tokens

    def clear(self) -> None:
        """Forget everything, locked blocks included (their locks are then released as no-ops)."""
        self._blocks.clear()
        self._leaf_heap.clear()
        self._locked_blocks = 0

    def lock(self, tokens: Sequence[int], namespace: int = _ROOT_ID) -> LockedPrefix:
        """Pin the cached prefix of `tokens` (as `lookup` measures it) against eviction until `unlock`."""
        path = self._match(tokens, namespace)
        self._touch(path)
        for block in path:
            if block.locks == 0:
                self._locked_blocks += 1
            block.locks += 1
        return LockedPrefix(tuple(path), len(path) * self.block_tokens)

    def unlock(self, locked: LockedPrefix) -> None:
        for block in locked.blocks:
            block.locks -= 1
            if block.locks == 0 and self._blocks.get(block.key) is block:
                self._locked_blocks -= 1
                if block.children == 0:
                    self._push_leaf(block)  # evictable again

    def lookup(self, tokens: Sequence[int], namespace: int = _ROOT_ID) -> int:
        """Number of leading tokens of `tokens` already cached (a multiple of block_tokens); touches them."""
        path = self._match(tokens, namespace)
        self._touch(path)
        return len(path) * self.block_tokens

    def insert(self, tokens: Sequence[int], namespace: int = _ROOT_ID) -> None:
        """Cache every full block of `tokens`, evicting LRU leaves to make room.

        When the cache cannot hold the whole prefix even after evicting everything else, the prefix is cut to
        what fits: its first blocks are the ones worth keeping.
        """
        path = self._match(tokens, namespace)
        self._touch(path)
        size = self.block_tokens
        wanted = len(tokens) // size - len(path)
        if wanted <= 0:
            return
        protected = path[-1] if path else None
        free_blocks = self.capacity_tokens // size - len(self._blocks)
        if wanted > free_blocks:
            self._evict_blocks(wanted - free_blocks, protected)
            free_blocks = self.capacity_tokens // size - len(self._blocks)
        parent = protected
        for index in range(len(path), len(path) + min(wanted, free_blocks)):
            parent = self._add(parent, tuple(tokens[index * size:(index + 1) * size]), namespace)

    def evict(self, num_tokens: int) -> int:
        """Evict LRU leaves until at least `num_tokens` are freed (or the cache is empty); returns tokens freed."""
        if num_tokens <= 0:
            return 0
        blocks = -(-num_tokens // self.block_tokens)
        return self._evict_blocks(blocks, None) * self.block_tokens

    def _match(self, tokens: Sequence[int], namespace: int) -> list[_Block]:
        size = self.block_tokens
        path: list[_Block] = []
        parent_id = namespace
        for start in range(0, len(tokens) - size + 1, size):
            block = self._blocks.get((parent_id, tuple(tokens[start:start + size])))
            if block is None:
                break
            path.append(block)
            parent_id = block.node_id
        return path

    def _touch(self, path: list[_Block]) -> None:
        # Blocks inserted right after share this time, so a parent is never older than its child.
        self._clock += 1
        if not path:
            return
        for block in path:
            block.last_access = self._clock
        leaf = path[-1]
        if leaf.children == 0:
            self._push_leaf(leaf)

    def _add(self, parent: _Block | None, block_tokens: tuple[int, ...], namespace: int) -> _Block:
        parent_id = parent.node_id if parent is not None else namespace
        block = _Block((parent_id, block_tokens), self._next_id, parent, self._clock)
        self._next_id += 1
        self._blocks[block.key] = block
        if parent is not None:
            parent.children += 1
        self._push_leaf(block)
        return block

    def _push_leaf(self, block: _Block) -> None:
        heapq.heappush(self._leaf_heap, (block.last_access, block.node_id, block))
        if len(self._leaf_heap) > 2 * len(self._blocks) + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._leaf_heap = [(b.last_access, b.node_id, b) for b in self._blocks.values() if b.children == 0]
        heapq.heapify(self._leaf_heap)

    def _evict_blocks(self, count: int, protected: _Block | None) -> int:
        evicted = 0
        kept: list[tuple[int, int, _Block]] = []
        while evicted < count and self._leaf_heap:
            entry = heapq.heappop(self._leaf_heap)
            access, _, block = entry
            if block.children or access != block.last_access or self._blocks.get(block.key) is not block:
                continue  # stale entry: touched again since, gained a child, or already evicted
            if block.locks:
                continue  # pinned by a running request; unlock() puts it back
            if block is protected:
                kept.append(entry)
                continue
            del self._blocks[block.key]
            evicted += 1
            parent = block.parent
            if parent is not None:
                parent.children -= 1
                if parent.children == 0:
                    heapq.heappush(self._leaf_heap, (parent.last_access, parent.node_id, parent))
        for entry in kept:
            heapq.heappush(self._leaf_heap, entry)
        return evicted
