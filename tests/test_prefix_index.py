import random
import tracemalloc

import pytest

from gateway.routing import hashing
from gateway.routing.hashing import block_hashes
from gateway.routing.prefix_index import PrefixIndex


def test_shared_prefix_matches_exactly_its_length_in_blocks() -> None:
    index = PrefixIndex(capacity_blocks=1000)
    shared = "s" * 640  # 10 blocks of 64
    index.insert(block_hashes(shared + "first question, long enough to fill one block" * 3))
    other = block_hashes(shared + "another question entirely, also a block or more" * 3)
    assert index.match(other) == 10


def test_chained_hash_depends_on_everything_before_the_block() -> None:
    assert block_hashes("a" * 64 + "b" * 64)[1] != block_hashes("c" * 64 + "b" * 64)[1]
    assert block_hashes("x" * 63) == []


def test_a_long_ascii_prompt_hashes_as_one_piece_would_in_any_block_size(monkeypatch: pytest.MonkeyPatch) -> None:
    text = "".join(f"word {i} " for i in range(200))  # 1,690 characters
    whole = {block: block_hashes(text, block) for block in (8, 48, 64)}
    monkeypatch.setattr(hashing, "_ENCODE_CHARS", 100)  # pieces of 96 (block 8, 48) and 64 characters
    assert {block: block_hashes(text, block) for block in (8, 48, 64)} == whole
    assert block_hashes(text[:1000] + "é" + text[1000:], 64)[:15] == whole[64][:15]  # non-ASCII: one way only


def test_a_leaf_is_a_cached_block_no_cached_prompt_continues() -> None:
    index = PrefixIndex(capacity_blocks=10)
    index.insert([1, 2, 3])
    assert index.is_leaf(3) and not index.is_leaf(2) and not index.is_leaf(99)
    index.insert([1, 2, 3, 4])
    assert not index.is_leaf(3) and index.is_leaf(4)


def test_evicts_least_recently_used_leaves_first_keeping_shared_heads() -> None:
    index = PrefixIndex(capacity_blocks=6)
    system = [1, 2]
    index.insert(system + [10, 11])  # conversation A
    index.insert(system + [20, 21])  # conversation B, newer
    assert index.size_blocks == 6
    index.insert(system + [30])  # needs one block: A's deepest block goes
    assert index.match(system + [10, 11]) == 3
    assert index.match(system + [20, 21]) == 4
    index.insert(system + [30, 31, 32])  # A goes entirely, the shared system prompt stays
    assert index.match(system + [10]) == 2
    assert index.match(system) == 2
    index.check_invariants()


def test_touching_a_prefix_protects_it_from_eviction() -> None:
    index = PrefixIndex(capacity_blocks=4)
    index.insert([1, 2])
    index.insert([3, 4])
    index.insert([1, 2])  # used again: now [3, 4] is the oldest
    index.insert([5, 6])
    assert index.match([1, 2]) == 2
    assert index.match([3, 4]) == 0


def test_prompt_longer_than_capacity_keeps_its_head() -> None:
    index = PrefixIndex(capacity_blocks=3)
    index.insert([1, 2, 3, 4, 5])
    assert index.size_blocks == 3
    assert index.match([1, 2, 3, 4, 5]) == 3


def test_truncate_forgets_the_evicted_tail_and_its_descendants() -> None:
    index = PrefixIndex(capacity_blocks=100)
    index.insert([1, 2, 3, 4])
    index.insert([1, 2, 3, 9])
    index.insert([1, 7])
    assert index.truncate([1, 2, 3, 4], keep_blocks=1) == 4  # 2, 3, 4 and 9
    assert index.match([1, 2]) == 1
    assert index.match([1, 7]) == 2
    assert index.truncate([1, 2], keep_blocks=1) == 0
    index.check_invariants()


def test_lowering_capacity_evicts_at_once() -> None:
    index = PrefixIndex(capacity_blocks=10)
    index.insert(list(range(1, 11)))
    index.capacity_blocks = 4
    assert index.size_blocks == 4
    index.check_invariants()


def test_created_at_orders_first_insertion_across_indexes_sharing_a_clock() -> None:
    ticks = iter(range(1, 100)).__next__
    first, second = PrefixIndex(10, ticks), PrefixIndex(10, ticks)
    first.insert([1, 2])
    second.insert([1, 2])
    first.insert([1, 2])  # a later use does not change creation time
    assert first.created_at(2) < second.created_at(2)
    assert first.created_at(99) == 0


def test_a_cached_block_costs_well_under_200_bytes() -> None:
    # It was ~330 with a set of children per node, so 86 MB for the quarter of an index a 30 MB prompt may claim.
    index = PrefixIndex(capacity_blocks=100_000)
    chain = [hash(("chain", i)) for i in range(20_000)]
    branches = [[*chain[:100], *(hash((b, i)) for i in range(20))] for b in range(1_000)]
    tracemalloc.start()
    try:
        index.insert(chain)
        for branch in branches:
            index.insert(branch)
        used_bytes = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    index.check_invariants()
    assert used_bytes / index.size_blocks < 200


@pytest.mark.parametrize("seed", range(5))
def test_invariants_hold_after_random_operations(seed: int) -> None:
    rng = random.Random(seed)
    index = PrefixIndex(capacity_blocks=rng.randint(5, 60))
    prompts = [[rng.randint(1, 6) for _ in range(rng.randint(1, 3))] for _ in range(20)]
    for _ in range(400):
        path = rng.choice(prompts) + [rng.randint(1, 40) for _ in range(rng.randint(0, 12))]
        hashes = [hash(tuple(path[: i + 1])) for i in range(len(path))]  # chained, like block_hashes
        operation = rng.random()
        if operation < 0.6:
            index.insert(hashes)
            assert index.match(hashes) == min(len(hashes), index.capacity_blocks)
        elif operation < 0.8:
            index.truncate(hashes, rng.randint(0, len(hashes)))
        elif operation < 0.9:
            index.capacity_blocks = rng.randint(1, 80)
        elif operation < 0.95:
            index.clear()
        else:
            assert 0 <= index.match(hashes) <= len(hashes)
        index.check_invariants()
        assert index.match(hashes) == _leading_present(index, hashes)


def _leading_present(index: PrefixIndex, hashes: list[int]) -> int:
    """`match` the slow way: block by block until one is absent (the bisection must agree)."""
    present = 0
    while present < len(hashes) and index.created_at(hashes[present]):
        present += 1
    return present


class _EagerIndex:
    """The index as first written, for reference: a use touches every block of the prompt, and eviction scans
    for the least recently used leaf. The index marks only a prompt's last block; it must keep and evict the
    same blocks, in the same order."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.parent: dict[int, int | None] = {}
        self.children: dict[int, set[int]] = {}
        self.last_use: dict[int, int] = {}
        self.tick = 0

    def insert(self, hashes: list[int]) -> None:
        hashes = hashes[: self.capacity_blocks]
        if not hashes:
            return
        self.tick += 1
        parent = None
        for key in hashes:
            if key not in self.parent:
                self.parent[key], self.children[key] = parent, set()
                if parent is not None:
                    self.children[parent].add(key)
            self.last_use[key] = self.tick
            parent = key
        self.evict()

    def evict(self) -> None:
        while len(self.parent) > self.capacity_blocks:
            self.remove(min((self.last_use[k], k) for k in self.parent if not self.children[k])[1])

    def remove(self, key: int) -> None:
        parent = self.parent.pop(key)
        del self.last_use[key], self.children[key]
        if parent is not None:
            self.children[parent].discard(key)

    def truncate(self, hashes: list[int], keep_blocks: int) -> None:
        if keep_blocks >= len(hashes) or hashes[keep_blocks] not in self.parent:
            return
        stack, order = [hashes[keep_blocks]], []
        while stack:
            order.append(key := stack.pop())
            stack.extend(self.children[key])
        for key in reversed(order):
            self.remove(key)

    def paths(self) -> list[list[int]]:
        leaves = sorted((self.last_use[k], k) for k in self.parent if not self.children[k])
        paths = []
        for _, key in leaves:
            path: list[int] = []
            node: int | None = key
            while node is not None:
                path.append(node)
                node = self.parent[node]
            paths.append(path[::-1])
        return paths


@pytest.mark.parametrize("seed", range(20))
def test_keeps_and_evicts_what_touching_every_block_would(seed: int) -> None:
    rng = random.Random(seed)
    capacity = rng.randint(5, 40)
    index, reference = PrefixIndex(capacity_blocks=capacity), _EagerIndex(capacity)
    prompts = [[rng.randint(1, 4) for _ in range(rng.randint(1, 4))] for _ in range(8)]
    for _ in range(300):
        path = rng.choice(prompts) + [rng.randint(1, 9) for _ in range(rng.randint(0, 8))]
        hashes = [hash(tuple(path[: i + 1])) for i in range(len(path))]
        if rng.random() < 0.85:
            index.insert(hashes)
            reference.insert(hashes)
        else:
            keep = rng.randint(0, len(hashes))
            index.truncate(hashes, keep)
            reference.truncate(hashes, keep)
        assert index.paths() == reference.paths()


def test_one_request_may_record_a_quarter_of_the_index_and_at_least_one_block() -> None:
    assert PrefixIndex(100).record_limit_blocks == 25
    assert PrefixIndex(3).record_limit_blocks == 1
    index = PrefixIndex(100)
    index.capacity_blocks = 40  # the engine reported a smaller cache
    assert index.record_limit_blocks == 10
