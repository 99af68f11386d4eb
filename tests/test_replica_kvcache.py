"""The simulated replica's prefix cache and tokenizer: hits, eviction order, capacity, determinism."""

from __future__ import annotations

import random
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.kvcache import PrefixKVCache, _Block
from simulator.tokenizer import GENERATION_PROMPT, count_tokens, render_chat, tokenize

B = 4  # small blocks keep the examples readable


def seq(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * B))


def check_invariants(cache: PrefixKVCache) -> None:
    """Recount everything the cache keeps incrementally."""
    blocks: dict[object, _Block] = cache._blocks
    assert cache.used_tokens == len(blocks) * cache.block_tokens <= cache.capacity_tokens
    children = {id(b): 0 for b in blocks.values()}
    for block in blocks.values():
        if block.parent is not None:
            assert blocks.get(block.parent.key) is block.parent, "a cached block's parent must be cached"
            assert block.key[0] == block.parent.node_id
            assert block.parent.last_access >= block.last_access, "a parent is never older than its child"
            children[id(block.parent)] += 1
    for block in blocks.values():
        assert block.children == children[id(block)]


def test_repeated_prompt_hits_its_full_blocks_only() -> None:
    cache = PrefixKVCache(capacity_tokens=100, block_tokens=B)
    tokens = seq(0, 3) + [999, 998]           # 3 full blocks and a partial one
    assert cache.lookup(tokens) == 0
    cache.insert(tokens)
    assert cache.used_tokens == 3 * B
    assert cache.lookup(tokens) == 3 * B


def test_shared_prefix_gives_partial_hit() -> None:
    cache = PrefixKVCache(capacity_tokens=100, block_tokens=B)
    cache.insert(seq(0, 4))
    other = seq(0, 2) + seq(500, 2)
    assert cache.lookup(other) == 2 * B
    cache.insert(other)
    assert cache.used_tokens == 6 * B         # the shared blocks are stored once


def test_same_block_after_different_prefix_is_a_miss() -> None:
    cache = PrefixKVCache(capacity_tokens=100, block_tokens=B)
    cache.insert(seq(0, 1) + seq(100, 1))
    assert cache.lookup(seq(50, 1) + seq(100, 1)) == 0


def test_eviction_drops_the_last_blocks_of_a_prefix_first() -> None:
    cache = PrefixKVCache(capacity_tokens=4 * B, block_tokens=B)
    first = seq(0, 4)
    cache.insert(first)
    cache.insert(seq(100, 2))                 # needs 2 blocks: first's tail goes
    assert cache.lookup(first) == 2 * B
    assert cache.used_tokens == 4 * B


def test_eviction_takes_the_least_recently_used_leaf() -> None:
    cache = PrefixKVCache(capacity_tokens=3 * B, block_tokens=B)
    a, b, c = seq(0, 1), seq(100, 1), seq(200, 1)
    for tokens in (a, b, c):
        cache.insert(tokens)
    cache.lookup(a)                           # a is now newer than b
    cache.insert(seq(300, 1))
    assert cache.lookup(b) == 0
    assert cache.lookup(a) == B and cache.lookup(c) == B


def test_interior_block_is_not_evicted_while_it_has_children() -> None:
    cache = PrefixKVCache(capacity_tokens=3 * B, block_tokens=B)
    cache.insert(seq(0, 2))
    cache.insert(seq(100, 1))
    cache.lookup(seq(0, 1))                   # touches only the shared first block
    cache.insert(seq(200, 1))                 # must evict a leaf: (0, 1)'s child, not the touched parent
    assert cache.lookup(seq(0, 2)) == B
    check_invariants(cache)


def test_prefix_longer_than_capacity_keeps_its_first_blocks() -> None:
    cache = PrefixKVCache(capacity_tokens=3 * B, block_tokens=B)
    cache.insert(seq(0, 10))
    assert cache.used_tokens == 3 * B
    assert cache.lookup(seq(0, 10)) == 3 * B


def test_insert_extending_a_cached_prefix_does_not_evict_that_prefix() -> None:
    cache = PrefixKVCache(capacity_tokens=3 * B, block_tokens=B)
    cache.insert(seq(0, 1))
    cache.insert(seq(100, 2))
    cache.insert(seq(0, 3))                   # extends the older prefix, evicting the other one
    assert cache.lookup(seq(0, 3)) == 3 * B
    check_invariants(cache)


def test_evict_and_clear_free_tokens() -> None:
    cache = PrefixKVCache(capacity_tokens=100, block_tokens=B)
    cache.insert(seq(0, 5))
    assert cache.evict(2 * B - 1) == 2 * B    # whole blocks
    assert cache.lookup(seq(0, 5)) == 3 * B
    cache.clear()
    assert cache.used_tokens == 0 and cache.lookup(seq(0, 5)) == 0


def test_invariants_hold_after_random_operations() -> None:
    rng = random.Random(7)
    cache = PrefixKVCache(capacity_tokens=40 * B, block_tokens=B)
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(1, 8) * B)] for _ in range(6)]
    for step in range(3000):
        tokens = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randrange(0, 6 * B))]
        operation = rng.random()
        if operation < 0.45:
            cache.insert(tokens)
        elif operation < 0.9:
            hit = cache.lookup(tokens)
            assert hit % B == 0 and hit <= len(tokens)
        elif operation < 0.98:
            cache.evict(rng.randrange(1, 10 * B))
        else:
            cache.clear()
        if step % 50 == 0:
            check_invariants(cache)
    check_invariants(cache)


def test_just_inserted_sequence_is_fully_cached_when_it_fits() -> None:
    rng = random.Random(3)
    cache = PrefixKVCache(capacity_tokens=20 * B, block_tokens=B)
    for _ in range(500):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 20 * B + 1))]
        cache.insert(tokens)
        assert cache.lookup(tokens) == len(tokens) // B * B


def test_tokenize_is_four_characters_per_token_and_stable_across_processes() -> None:
    text = "The quick brown fox jumps over the lazy dog; ünïcødé too."
    tokens = tokenize(text)
    assert len(tokens) == count_tokens(text) == -(-len(text) // 4)
    assert tokenize(text[:20]) == tokens[:5]
    other = subprocess.run(
        [sys.executable, "-c", f"from simulator.tokenizer import tokenize; print(tokenize({text!r}))"],
        capture_output=True, text=True, check=True, timeout=30)
    assert other.stdout.strip() == str(tokens)


def test_render_chat_joins_text_parts_and_puts_tools_in_the_system_turn() -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    text = render_chat([{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"},
                                                     {"type": "text", "text": "b"}]}], tools)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "lookup"' in text
    assert "<|im_start|>user\na\nb<|im_end|>\n" in text
    assert text.endswith(GENERATION_PROMPT)


messages_strategy = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]),
                           "content": st.one_of(st.text(max_size=30),
                                                st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                "text": st.text(max_size=10)}),
                                                         max_size=3))}),
    min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(messages=messages_strategy, system=st.text(max_size=40), with_tools=st.booleans())
def test_render_chat_is_prefix_stable_across_turns(messages: list[dict[str, object]], system: str,
                                                   with_tools: bool) -> None:
    tools = [{"type": "function", "function": {"name": "f"}}] if with_tools else None
    history = [{"role": "system", "content": system}, *messages]
    for turn in range(1, len(history)):
        shorter = render_chat(history[:turn], tools)
        longer = render_chat(history[:turn + 1], tools)
        assert longer.startswith(shorter[:-len(GENERATION_PROMPT)])
        # And the tokens: all but the last partial chunk of the shorter text are shared.
        shared = len(shorter[:-len(GENERATION_PROMPT)]) // 4
        assert tokenize(longer)[:shared] == tokenize(shorter)[:shared]


def test_locked_prefix_survives_eviction_until_unlocked() -> None:
    cache = PrefixKVCache(capacity_tokens=4 * B, block_tokens=B)
    cache.insert(seq(0, 2))
    locked = cache.lock(seq(0, 2))
    assert locked.tokens == 2 * B and cache.locked_tokens == 2 * B
    cache.insert(seq(100, 4))                 # only the 2 unlocked blocks' worth fits
    assert cache.lookup(seq(0, 2)) == 2 * B
    assert cache.lookup(seq(100, 4)) == 2 * B
    cache.unlock(locked)
    assert cache.locked_tokens == 0
    cache.insert(seq(200, 4))
    assert cache.lookup(seq(0, 2)) == 0
    check_invariants(cache)


def test_each_adapter_namespace_caches_the_same_tokens_apart() -> None:
    cache = PrefixKVCache(capacity_tokens=100, block_tokens=B)
    tokens = seq(0, 3)
    cache.insert(tokens, namespace=-1)
    assert cache.lookup(tokens, namespace=-1) == 3 * B
    assert cache.lookup(tokens, namespace=-2) == 0 and cache.lookup(tokens) == 0
    cache.insert(tokens)
    assert cache.used_tokens == 6 * B  # two entries for the same tokens
    check_invariants(cache)
