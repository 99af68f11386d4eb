"""A backend's own state: what exchanges and health checks do to it, and which backends the pool offers."""

from __future__ import annotations

import time

import pytest

from gateway.api.prompts import Endpoint
from gateway.app import Exchange, Gateway
from gateway.config import GatewayConfig
from gateway.errors import ModelNotFound, NoHealthyBackend
from gateway.fleet.backends import Backend, BackendSpec
from gateway.fleet.engines import Engine, EngineInfo, ModelInfo
from gateway.fleet.outlier import Outlier, OutlierConfig
from gateway.fleet.pool import Pool
from gateway.fleet.upstream import Failure, UpstreamFailure
from gateway.routing.router import Router
from tests.policy_fixtures import make_backends, request, text

OUTLIER = OutlierConfig(consecutive_failures=3, base_ejection_s=10.0, max_ejection_s=60.0)


def pool(count: int) -> Pool:
    pool = Pool([BackendSpec(f"http://b{i}", model="m") for i in range(count)], 10_000, retry_after_s=5,
                outlier=OUTLIER)
    for backend in pool.backends:
        backend.health_check_passed(success_threshold=1)
    return pool


def with_history(backend: Backend) -> None:
    backend.index.insert(request(text("a conversation", 2000)).hashes)


def test_client_errors_never_eject_a_backend() -> None:
    backend = pool(1).backends[0]
    for status in (400, 404, 413, 422, 429, 501) * 10:
        backend.exchange_answered(status)
    assert not backend.outlier.ejected and backend.outlier.consecutive_failures == 0


@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_consecutive_server_errors_eject_the_backend_but_keep_its_index(status: int) -> None:
    backend = pool(1).backends[0]
    with_history(backend)
    for _ in range(3):
        backend.exchange_answered(status)
    assert backend.outlier.ejected and backend.healthy
    assert backend.index.size_blocks > 0  # ejected is not restarted: the engine still holds its cache
    assert backend.describe()["ejected"] is True
    assert backend.describe()["outlier"]["cause"] == "5xx"


def test_refused_connection_ejects_at_once_and_a_good_health_check_ends_it() -> None:
    backend = pool(1).backends[0]
    with_history(backend)
    backend.exchange_failed(Failure.CONNECT, "ConnectionRefusedError")
    assert backend.outlier.ejected and backend.index.size_blocks > 0
    backend.health_check_passed(success_threshold=1)
    assert not backend.outlier.ejected


def test_hung_backend_is_ejected_at_its_first_timeout_and_its_health_checks_do_not_bring_it_back() -> None:
    backend = pool(1).backends[0]
    backend.exchange_failed(Failure.FIRST_BYTE_TIMEOUT, "no first byte")
    backend.health_check_passed(success_threshold=1)
    assert backend.outlier.ejected


def test_a_connection_broken_before_the_answer_counts_but_does_not_eject_alone() -> None:
    backend = pool(1).backends[0]
    backend.exchange_failed(Failure.BROKEN_BEFORE_ANSWER, "ServerDisconnectedError")
    assert not backend.outlier.ejected and backend.outlier.consecutive_failures == 1


def test_the_gateways_own_resource_failure_never_counts_against_a_backend() -> None:
    gateway = Gateway(GatewayConfig(backends=(BackendSpec("http://b0", model="m"),), outlier=OUTLIER))
    backend = gateway.pool.backends[0]
    backend.health_check_passed(success_threshold=1)
    routing = gateway.router.routing_request("hello")
    exchange = Exchange(Endpoint.CHAT, "POST", "/v1/chat/completions", {}, b"{}", "m", False, "id", time.monotonic())
    for _ in range(10):
        placement = gateway.router.place("m", routing)
        assert not gateway.retry_after(placement, exchange, UpstreamFailure(Failure.LOCAL, "EMFILE"), 0)
    assert not backend.outlier.ejected and backend.outlier.consecutive_failures == 0
    assert backend.in_flight == 0


def test_a_failure_that_is_not_retried_counts_once() -> None:
    gateway = Gateway(GatewayConfig(backends=(BackendSpec("http://b0", model="m"),), max_retries=0,
                                    outlier=OUTLIER))
    backend = gateway.pool.backends[0]
    backend.health_check_passed(success_threshold=1)
    exchange = Exchange(Endpoint.CHAT, "POST", "/v1/chat/completions", {}, b"{}", "m", False, "id", time.monotonic())
    placement = gateway.router.place("m", gateway.router.routing_request("hello"))
    broken = UpstreamFailure(Failure.BROKEN_BEFORE_ANSWER, "ServerDisconnectedError")
    assert not gateway.retry_after(placement, exchange, broken, 0)
    assert backend.outlier.consecutive_failures == 1


def test_ejected_backends_get_no_traffic_unless_every_backend_is_ejected() -> None:
    fleet = pool(3)
    first, second, third = fleet.backends
    first.exchange_failed(Failure.CONNECT, "refused")
    assert fleet.serving("m") == [second, third]
    second.exchange_failed(Failure.CONNECT, "refused")
    third.exchange_failed(Failure.CONNECT, "refused")
    assert fleet.serving("m") == [first, second, third]  # panic: better a failing backend than none


def test_failed_health_checks_past_the_threshold_take_the_backend_out_and_forget_its_cache() -> None:
    backend = pool(1).backends[0]
    with_history(backend)
    backend.health_check_failed("GET /health failed", failure_threshold=2)
    assert backend.healthy and backend.index.size_blocks > 0
    backend.health_check_failed("GET /health failed", failure_threshold=2)
    assert not backend.healthy and backend.index.size_blocks == 0


def test_a_backend_back_from_down_starts_with_no_ejection() -> None:
    backend = pool(1).backends[0]
    backend.exchange_failed(Failure.FIRST_BYTE_TIMEOUT, "no first byte")
    backend.health_check_failed("GET /health failed", failure_threshold=1)
    backend.health_check_passed(success_threshold=1)
    assert backend.healthy and not backend.outlier.ejected


def test_a_changed_model_forgets_the_cache_and_the_engine() -> None:
    backend = make_backends(1)[0]
    backend.model = None
    backend.discovered_model(ModelInfo("m", {"id": "m"}))
    backend.discovered_engine(EngineInfo(Engine.SGLANG, 1000), lambda tokens: (tokens or 0) // 16)
    assert backend.engine is Engine.SGLANG and backend.index.capacity_blocks == 62
    with_history(backend)
    backend.discovered_model(ModelInfo("n", {"id": "n"}))
    assert backend.model == "n" and backend.engine is None and backend.index.size_blocks == 0


def test_a_named_model_before_any_backend_answered_is_503_not_404() -> None:
    silent = Pool([BackendSpec("http://b0"), BackendSpec("http://b1")], 10_000, retry_after_s=5)
    with pytest.raises(NoHealthyBackend) as raised:
        silent.resolve_model("sim-llama-8b", None)
    assert raised.value.status_code == 503 and raised.value.headers() == {"retry-after": "5"}
    for backend in silent.backends:
        backend.discovered_model(ModelInfo("m", {"id": "m"}))
    with pytest.raises(ModelNotFound):
        silent.resolve_model("sim-llama-8b", None)


def test_a_half_open_backend_returns_at_its_probes_first_byte_not_at_the_end_of_a_long_answer() -> None:
    clock = [0.0]
    fleet = pool(1)
    backend = fleet.backends[0]
    backend.outlier = Outlier(OUTLIER, lambda: clock[0])
    backend.exchange_failed(Failure.FIRST_BYTE_TIMEOUT, "no first byte")
    clock[0] += OUTLIER.base_ejection_s
    router = Router(fleet, GatewayConfig().routing)
    probe = router.place("m", request("a long answer"))
    assert not backend.outlier.admits()  # one probe at a time
    probe.first_byte()
    assert not backend.outlier.ejected and backend.outlier.admits()
    probe.finish()
