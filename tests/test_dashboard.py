"""The dashboard: its snapshot (sampling, the bounded history, the window's rates) without a server, then its two
routes on a real gateway. The page itself runs in a browser in test_dashboard_browser.py."""

from __future__ import annotations

import httpx2
import pytest

from gateway.demo import print_banner
from gateway.fleet.backends import BackendSpec
from gateway.fleet.pool import Pool
from gateway.observe.dashboard import HISTORY_S, MAX_SAMPLES, WINDOW_S, Dashboard
from gateway.observe.metrics import GatewayMetrics
from simulator.fleet import Fleet

A, B = "http://127.0.0.1:30001", "http://127.0.0.1:30002"


def dashboard() -> Dashboard:
    pool = Pool([BackendSpec(A, "m"), BackendSpec(B, "m")], 1000, retry_after_s=1)
    return Dashboard(pool, GatewayMetrics(pool), "prefix_aware")


def answer(board: Dashboard, backend: str, route: str, prompt: int, cached: int, predicted: int) -> None:
    metrics = board.metrics
    metrics.requests.labels("chat", "m", backend, route, "200").inc()
    metrics.prompt_tokens.labels("m", backend).inc(prompt)
    metrics.cached_tokens.labels("m", backend).inc(cached)
    metrics.predicted_cached_tokens.labels("m", backend).inc(predicted)


def test_page_is_shipped_and_polls_the_relative_data_url() -> None:
    board = dashboard()
    assert "fetch(`dashboard/data?since=" in board.html
    assert "http://" not in board.html.replace('"http://www.w3.org/2000/svg"', "")  # nothing from elsewhere
    assert [route.path for route in board.routes()] == ["/dashboard", "/dashboard/data"]


def test_snapshot_describes_every_backend() -> None:
    snapshot = dashboard().snapshot(1000.0)
    assert [backend["url"] for backend in snapshot["backends"]] == [A, B]
    assert snapshot["policy"] == "prefix_aware"
    assert snapshot["window"]["fleet"]["reported_hit_rate"] is None  # no tokens yet, no rate
    assert len(snapshot["series"]) == 1


def test_window_counts_only_what_happened_since_the_oldest_sample() -> None:
    board = dashboard()
    answer(board, A, "prefix", prompt=100, cached=100, predicted=100)  # before the page opened: not counted
    board.snapshot(1000.0)
    answer(board, A, "prefix", prompt=100, cached=80, predicted=90)
    answer(board, B, "least-load", prompt=100, cached=0, predicted=0)
    window = board.snapshot(1002.0)["window"]
    assert window["seconds"] == 2.0
    assert window["routes"] == {"least-load": 1.0, "prefix": 1.0}
    assert window["backends"][A]["requests_per_s"] == 0.5
    assert window["backends"][A]["reported_hit_rate"] == 0.8
    assert window["backends"][A]["predicted_hit_rate"] == 0.9
    assert window["fleet"]["reported_hit_rate"] == 0.4
    assert window["fleet"]["requests"] == 2.0


def test_rates_cover_the_last_minute_while_charts_keep_the_history() -> None:
    board = dashboard()
    board.snapshot(1000.0)
    answer(board, A, "prefix", prompt=100, cached=50, predicted=50)
    for second in range(1, 121):
        board.snapshot(1000.0 + second)
    snapshot = board.snapshot(1121.0)
    assert snapshot["window"]["seconds"] == WINDOW_S
    assert snapshot["window"]["fleet"]["requests"] == 0.0
    assert len(snapshot["series"]) == 122


def test_polls_closer_than_the_interval_take_no_new_sample() -> None:
    board = dashboard()
    board.snapshot(1000.0)
    board.snapshot(1000.5)
    board.snapshot(1001.0)
    assert len(board.samples) == 2


def test_history_keeps_only_the_last_minutes() -> None:
    board = dashboard()
    for second in range(int(2 * HISTORY_S)):
        board.snapshot(1000.0 + second)
    assert len(board.samples) <= MAX_SAMPLES
    assert board.samples[-1].at_s - board.samples[0].at_s <= HISTORY_S


def test_since_sends_only_newer_chart_points_with_their_request_rate() -> None:
    board = dashboard()
    board.snapshot(1000.0)
    answer(board, A, "prefix", prompt=10, cached=0, predicted=0)
    answer(board, A, "prefix", prompt=10, cached=0, predicted=0)
    series = board.snapshot(1002.0, since_s=1000.0)["series"]
    assert [point["t"] for point in series] == [1002.0]
    assert series[0]["backends"][A]["requests_per_s"] == 1.0
    assert series[0]["backends"][B] == {"healthy": False, "in_flight": 0, "queued_prefill_tokens": 0,
                                        "kv_usage": None, "requests_per_s": 0.0}


def test_gateway_serves_the_page_and_its_data(llm_fleet: tuple[Fleet, str, list[str]]) -> None:
    _, gateway, replicas = llm_fleet
    page = httpx2.get(gateway + "/dashboard", timeout=10, trust_env=False)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    data = httpx2.get(gateway + "/dashboard/data", timeout=10, trust_env=False).json()
    assert [backend["url"] for backend in data["backends"]] == replicas
    assert all(backend["healthy"] for backend in data["backends"])


def test_data_refuses_a_since_that_is_not_a_number(llm_fleet: tuple[Fleet, str, list[str]]) -> None:
    _, gateway, _ = llm_fleet
    response = httpx2.get(gateway + "/dashboard/data?since=yesterday", timeout=10, trust_env=False)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "since"


def test_demo_banner_prints_the_dashboard_url(capsys: pytest.CaptureFixture[str]) -> None:
    print_banner("http://127.0.0.1:8000", ["http://127.0.0.1:30001"], "/tmp/gateway.log")
    assert "http://127.0.0.1:8000/dashboard" in capsys.readouterr().out
