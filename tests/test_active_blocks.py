"""The distinct blocks of the requests in flight, kept as a tree of the running prompts, agree with a plain count
of every block's requests, whatever the order in which requests that share prefixes start and end."""

from __future__ import annotations

import collections

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.active_blocks import ActiveBlocks
from gateway.routing.hashing import block_hashes

# Prompts built from a few shared heads and tails, so that requests share prefixes of every length.
WORDS = ["system prompt " * 9, "a long shared document " * 12, "question one? " * 5, "question two! " * 5, "x" * 64]
prompts = st.lists(st.sampled_from(WORDS), min_size=0, max_size=5).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), prompts, st.integers(0, 20)), max_size=60))
def test_the_count_is_that_of_the_blocks_some_request_runs_through(steps: list[tuple[bool, str, int]]) -> None:
    active, expected = ActiveBlocks(), collections.Counter[int]()
    running: list[list[int]] = []
    for start, prompt, pick in steps:
        if start or not running:
            hashes = block_hashes(prompt, 16)
            active.add(hashes)
            expected.update(hashes)
            running.append(hashes)
        else:
            hashes = running.pop(pick % len(running))
            active.release(hashes)
            expected.subtract(hashes)
        assert active.count == sum(1 for requests in expected.values() if requests > 0)
    for hashes in running:
        active.release(hashes)
    assert active.count == 0
    assert not (active._ending or active._continued or active._under_root)  # nothing kept for idle blocks


def test_a_new_turn_behind_a_running_history_adds_only_its_own_blocks() -> None:
    active = ActiveBlocks()
    history = block_hashes("a long shared document " * 40, 64)
    turn = block_hashes("a long shared document " * 40 + "and one more question? " * 6, 64)
    active.add(history)
    active.add(turn)
    assert active.count == len(turn)
    active.release(history)
    assert active.count == len(turn)
    active.release(turn)
    assert active.count == 0
