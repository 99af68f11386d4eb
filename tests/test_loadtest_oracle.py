"""The oracle: requests replayed in order through one cache of the fleet's capacity, checked by hand."""

from __future__ import annotations

from loadtest.oracle import OracleRequest, chat_request, oracle_hit_rate
from simulator.tokenizer import render_chat


def text(tokens: int, char: str) -> str:
    return char * (4 * tokens)   # 4 characters per token


def test_hand_checked_sequence_with_16_token_blocks() -> None:
    # A = 32 tokens (2 blocks), A+B = 48 tokens, C = 20 tokens (1 full block + 4).
    a, b, c = text(32, "a"), text(16, "b"), text(20, "c")
    result = oracle_hit_rate([OracleRequest(a), OracleRequest(a + b), OracleRequest(c), OracleRequest(a + b)],
                             capacity_tokens=1000)
    # 1st: cold, 0 of 32. 2nd: A's 2 blocks, 32 of 48. 3rd: cold, 0 of 20. 4th: all 3 blocks, 48 of 48.
    assert (result.prompt_tokens, result.cached_tokens) == (32 + 48 + 20 + 48, 0 + 32 + 0 + 48)
    assert abs(result.hit_rate - 80 / 148) < 1e-12


def test_capacity_bounds_the_oracle() -> None:
    # Two 2-block prompts alternating in a 2-block cache: each evicts the other, nothing ever hits.
    x, y = text(32, "x"), text(32, "y")
    alternating = [OracleRequest(p) for p in (x, y, x, y)]
    assert oracle_hit_rate(alternating, capacity_tokens=32).cached_tokens == 0
    assert oracle_hit_rate(alternating, capacity_tokens=64).cached_tokens == 64


def test_answer_is_cached_so_the_next_turn_hits_its_history() -> None:
    turn1 = [{"role": "user", "content": text(30, "q")}]
    answer = text(16, "r")
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": text(10, "s")}]
    first, second = chat_request(turn1, answer), chat_request(turn2)
    assert second.prompt.startswith(first.prompt + answer)
    result = oracle_hit_rate([first, second], capacity_tokens=10_000)
    shared_tokens = len(first.prompt + answer) // 4
    assert result.cached_tokens == shared_tokens // 16 * 16
    assert result.prompt_tokens == -(-len(first.prompt) // 4) + -(-len(second.prompt) // 4)


def test_empty_sequence_has_zero_hit_rate() -> None:
    assert oracle_hit_rate([], capacity_tokens=100).hit_rate == 0.0
    assert render_chat([{"role": "user", "content": "x"}]).endswith("assistant\n")
