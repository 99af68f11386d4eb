"""Block hashes resumed from remembered checkpoints are exactly those of hashing the whole prompt, whatever the
prompts share, their characters, the model's seed, and how full the memory is."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.hashing import PrefixHashes, block_hashes

PIECES = ["You are a helpful assistant. " * 20, "Here is the document: " + "lorem ipsum " * 90, "Q: why? ",
          "Réponds en français, s'il te plaît. " * 3, "\ud800 lone surrogate ", "a" * 700, "turn " * 40]
prompts = st.lists(st.sampled_from(PIECES), max_size=6).map("".join)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(prompts, st.sampled_from([1, 7, 2**63])), max_size=12), st.sampled_from([16, 64]),
       st.sampled_from([3, 32_768]))
def test_resumed_hashes_are_the_whole_prompts_hashes(requests: list[tuple[str, int]], block_chars: int,
                                                     max_checkpoints: int) -> None:
    memo = PrefixHashes(block_chars, max_checkpoints)
    for text, seed in requests:
        assert memo.of(text, seed) == block_hashes(text, block_chars, seed)


def test_a_conversations_next_turn_resumes_from_its_history() -> None:
    memo = PrefixHashes(64)
    history = "system prompt, long. " * 100
    memo.of(history)
    remembered = dict(memo._chains)
    turn = history + "assistant: an answer. user: and then? " * 10
    assert memo.of(turn) == block_hashes(turn)
    assert remembered.items() <= memo._chains.items()  # the history's checkpoints served, and stay
    assert len(memo._chains) == len(turn) // (64 * PrefixHashes.CHECKPOINT_BLOCKS)


def test_a_giant_prompt_is_hashed_as_block_hashes_does_without_being_remembered() -> None:
    memo = PrefixHashes(64)
    giant = "a long shared document " * 50_000  # 1.15 M characters: past the one-copy encoding bound
    assert memo.of(giant) == block_hashes(giant)
    assert not memo._chains
