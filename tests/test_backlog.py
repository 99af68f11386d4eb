"""PrefillBacklog: the prefill a newcomer would wait behind, and the rate a backend drains it at."""

import pytest

from gateway.routing.backlog import MIN_SAMPLES, PrefillBacklog


def taught(tokens_per_s: float) -> tuple[PrefillBacklog, float]:
    """A backlog that has seen MIN_SAMPLES prefills of 1,000 tokens served one after another at `tokens_per_s`;
    returns it and the time the last one finished."""
    backlog, now_s = PrefillBacklog(), 0.0
    for _ in range(MIN_SAMPLES):
        pending = backlog.add(1000, now_s)
        now_s += 1000 / tokens_per_s
        backlog.finish(pending, now_s)
    return backlog, now_s


def test_reserved_tokens_count_in_full_until_the_rate_is_learned() -> None:
    backlog = PrefillBacklog()
    backlog.finish(backlog.add(500, 0.0), 0.1)
    assert backlog.tokens_per_s is None
    backlog.add(800, 1.0)
    assert backlog.remaining_tokens(now_s=5.0) == 800


def test_learned_rate_is_tokens_over_the_seconds_work_was_pending() -> None:
    backlog, _ = taught(tokens_per_s=4000)
    assert backlog.tokens_per_s == pytest.approx(4000)


def test_the_oldest_request_is_credited_with_the_progress_since_it_started() -> None:
    backlog, now_s = taught(tokens_per_s=4000)
    backlog.add(2000, now_s)
    assert backlog.remaining_tokens(now_s) == 2000
    assert backlog.remaining_tokens(now_s + 0.25) == pytest.approx(1000)
    assert backlog.remaining_tokens(now_s + 10) == 0


def test_requests_behind_the_oldest_are_never_credited() -> None:
    backlog, now_s = taught(tokens_per_s=4000)
    oldest = backlog.add(1000, now_s)
    backlog.add(700, now_s + 0.1)
    backlog.add(300, now_s + 0.2)
    # Long past the time all three would take: a backend this late is stalled, not nearly done.
    assert backlog.remaining_tokens(now_s + 60) == 1000
    backlog.finish(oldest, now_s + 61)  # the next in line starts now, and the stall taught a slower rate
    assert backlog.remaining_tokens(now_s + 61) == 1000
    assert 0 < backlog.remaining_tokens(now_s + 61.1) < 1000
    assert backlog.tokens_per_s is not None and backlog.tokens_per_s < 1000


def test_a_batch_finishing_at_once_averages_into_the_rate() -> None:
    backlog = PrefillBacklog()
    for round_s in range(MIN_SAMPLES):  # three prompts batched: one second's work, three first bytes at once
        batch = [backlog.add(1000, float(round_s * 10)) for _ in range(3)]
        for pending in batch:
            backlog.finish(pending, round_s * 10 + 1.0)
    assert backlog.tokens_per_s == pytest.approx(3000, rel=0.05)  # the decay weighs the last sample a little more


def test_a_request_that_failed_before_its_first_byte_is_released_without_teaching_the_rate() -> None:
    backlog, now_s = taught(tokens_per_s=4000)
    failed = backlog.add(2000, now_s)
    backlog.add(1000, now_s)
    backlog.drop(failed, now_s + 0.001)  # a broken connection: its 1 ms says nothing about prefill speed
    assert backlog.tokens_per_s == pytest.approx(4000)
    assert backlog.reserved_tokens == 1000 and backlog.requests == 1
    # The one behind it got the engine's turn when the failed one left: 0.1 s later, 400 tokens are done.
    assert backlog.remaining_tokens(now_s + 0.101) == pytest.approx(600)


def test_a_failed_request_behind_the_oldest_leaves_the_oldest_its_turn() -> None:
    backlog, now_s = taught(tokens_per_s=1000)
    oldest = backlog.add(1000, now_s)
    behind = backlog.add(1000, now_s)  # the same size: it must not be taken for the oldest
    backlog.drop(behind, now_s + 0.9)
    backlog.finish(oldest, now_s + 1.0)
    assert backlog.tokens_per_s == pytest.approx(1000)
