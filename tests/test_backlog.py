"""PrefillBacklog: the prefill a newcomer would wait behind, and the rate a backend drains it at."""

import pytest

from gateway.backlog import MIN_SAMPLES, PrefillBacklog


def taught(tokens_per_s: float, start_s: float = 0.0) -> tuple[PrefillBacklog, float]:
    """A queue that has seen MIN_SAMPLES prefills of 1,000 tokens served one after another at `tokens_per_s`;
    returns it and the time the last one finished."""
    queue, now_s = PrefillBacklog(), start_s
    for _ in range(MIN_SAMPLES):
        queue.added(1000, 0, now_s)
        now_s += 1000 / tokens_per_s
        queue.done(1000, 0, 0, now_s)
    return queue, now_s


def test_reserved_tokens_count_in_full_until_the_rate_is_learned() -> None:
    queue = PrefillBacklog()
    queue.added(500, 0, 0.0)
    queue.done(500, 0, 0, 0.1)
    assert queue.tokens_per_s is None
    queue.added(800, 0, 1.0)
    assert queue.remaining_tokens(800, now_s=5.0) == 800


def test_learned_rate_is_tokens_over_the_seconds_work_was_pending() -> None:
    queue, _ = taught(tokens_per_s=4000)
    assert queue.tokens_per_s == pytest.approx(4000)


def test_work_sent_earlier_is_partly_done_and_never_below_zero() -> None:
    queue, now_s = taught(tokens_per_s=4000)
    queue.added(2000, 0, now_s)
    assert queue.remaining_tokens(2000, now_s) == 2000
    assert queue.remaining_tokens(2000, now_s + 0.25) == pytest.approx(1000)
    assert queue.remaining_tokens(2000, now_s + 10) == 0


def test_a_newcomer_queues_behind_what_was_sent_before_it() -> None:
    queue, now_s = taught(tokens_per_s=4000)
    queue.added(2000, 0, now_s)
    queue.added(1000, 2000, now_s + 0.25)  # the first is half done
    assert queue.remaining_tokens(3000, now_s + 0.25) == pytest.approx(2000)


def test_estimate_never_exceeds_what_is_still_reserved() -> None:
    queue, now_s = taught(tokens_per_s=100)  # a slow rate: the model lags
    queue.added(2000, 0, now_s)
    queue.added(500, 2000, now_s)
    queue.done(2000, 500, 1, now_s + 1)  # the engine was faster: only the second is left
    assert queue.remaining_tokens(500, now_s + 1) == 500


def test_a_batch_finishing_at_once_averages_into_the_rate() -> None:
    queue = PrefillBacklog()
    for round_s in range(MIN_SAMPLES):  # three prompts batched: one second's work, three first bytes at once
        for i in range(3):
            queue.added(1000, 1000 * i, float(round_s * 10))
        for left in (2, 1, 0):
            queue.done(1000, 1000 * left, left, round_s * 10 + 1.0)
    assert queue.tokens_per_s == pytest.approx(3000, rel=0.05)  # the decay weighs the last sample a little more

