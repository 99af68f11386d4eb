"""Outlier ejection's state machine, on a clock the test moves."""

from __future__ import annotations

from gateway.fleet.outlier import Outlier, OutlierConfig, OutlierState
from tests.fake_clock import FakeClock

CONFIG = OutlierConfig(consecutive_failures=3, base_ejection_s=10.0, max_ejection_s=60.0)


def outlier(config: OutlierConfig = CONFIG) -> tuple[Outlier, FakeClock]:
    clock = FakeClock(1000.0)
    return Outlier(config, clock), clock


def fail(target: Outlier, times: int, cause: str = "5xx") -> None:
    for _ in range(times):
        target.failed(cause, at_once=False)


def test_consecutive_failures_eject_and_a_success_between_them_starts_the_count_again() -> None:
    target, _ = outlier()
    fail(target, 2)
    target.succeeded()
    fail(target, 2)
    assert target.state is OutlierState.SERVING and target.admits()
    ejection = target.failed("5xx", at_once=False)
    assert ejection is not None and ejection.failures == 3 and ejection.duration_s == 10.0
    assert target.state is OutlierState.EJECTED and not target.admits()
    assert target.ejections_total == {"5xx": 1}


def test_strong_evidence_ejects_at_once() -> None:
    target, _ = outlier()
    ejection = target.failed("connect", at_once=True)
    assert ejection is not None and ejection.failures == 1
    assert target.ejected and target.cause == "connect"


def test_after_the_back_off_one_probe_at_a_time_and_its_success_restores() -> None:
    target, clock = outlier()
    fail(target, 3)
    clock.now_s += 10.0
    assert target.state is OutlierState.PROBING and target.admits()
    assert target.probe_started()
    assert not target.admits() and not target.probe_started()  # one at a time
    target.probe_ended()
    assert target.admits()  # the probe ended without a verdict (the client left): another may go
    assert target.succeeded()
    assert target.state is OutlierState.SERVING and not target.ejected


def test_a_failed_probe_ejects_again_for_twice_as_long_up_to_the_cap() -> None:
    target, clock = outlier()
    fail(target, 3)
    durations = [10.0]
    for _ in range(4):
        clock.now_s += durations[-1]
        assert target.probe_started()
        ejection = target.failed("5xx", at_once=False)  # the probe fails: one failure is enough
        assert ejection is not None
        durations.append(ejection.duration_s)
    assert durations == [10.0, 20.0, 40.0, 60.0, 60.0]


def eject_in_a_row(target: Outlier, clock: FakeClock, times: int) -> list[float]:
    """Eject `times` times, each time right after the back-off (a failed probe); returns the durations."""
    durations = []
    for _ in range(times):
        ejection = target.failed("5xx", at_once=True)
        assert ejection is not None
        durations.append(ejection.duration_s)
        clock.now_s += ejection.duration_s
    return durations


def test_a_backend_failing_again_soon_after_its_return_goes_on_doubling() -> None:
    target, clock = outlier()
    assert eject_in_a_row(target, clock, 2) == [10.0, 20.0]
    assert target.succeeded()
    clock.now_s += 1.0
    assert eject_in_a_row(target, clock, 1) == [40.0]


def test_each_base_period_of_good_service_halves_the_next_back_off() -> None:
    target, clock = outlier()
    assert eject_in_a_row(target, clock, 3) == [10.0, 20.0, 40.0]
    assert target.succeeded()
    clock.now_s += 25.0  # two base periods
    assert eject_in_a_row(target, clock, 1) == [20.0]


def test_answers_to_requests_sent_before_the_ejection_are_not_counted_again() -> None:
    target, clock = outlier()
    fail(target, 3)
    assert target.failed("5xx", at_once=True) is None
    assert not target.succeeded()  # a success of an older request does not cut the back-off short
    assert target.state is OutlierState.EJECTED
    clock.now_s += 10.0
    assert target.state is OutlierState.PROBING
    assert target.ejections_total == {"5xx": 1}


def test_a_good_health_check_ends_an_ejection_for_refused_connections_only() -> None:
    refused, _ = outlier()
    refused.failed("connect", at_once=True)
    assert refused.listening() and not refused.ejected
    hung, _ = outlier()
    hung.failed("first_byte_timeout", at_once=True)
    assert not hung.listening() and hung.ejected  # a hung engine's /health still answers


def test_zero_consecutive_failures_turns_ejection_off() -> None:
    target, _ = outlier(OutlierConfig(consecutive_failures=0))
    fail(target, 100)
    assert target.failed("connect", at_once=True) is None
    assert target.admits() and not target.ejected


def test_reset_forgets_the_streak() -> None:
    target, clock = outlier()
    eject_in_a_row(target, clock, 3)
    target.reset()
    assert not target.ejected
    assert eject_in_a_row(target, clock, 1) == [10.0]
