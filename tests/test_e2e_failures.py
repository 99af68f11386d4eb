"""Failing replicas: skipped, retried elsewhere, and reported in OpenAI's error shape, never hung."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import anthropic
import httpx2
import openai
import pytest

from gateway.routing.backlog import MIN_SAMPLES
from simulator.fleet import Fleet, free_port
from tests.conftest import FAST_GATEWAY, FAST_REPLICA
from tests.dropping_proxy import DroppingProxy, dropping_proxy


def ask(gateway: str, content: str = "hello", **extra: object) -> httpx2.Response:
    return httpx2.post(gateway + "/v1/chat/completions", trust_env=False, timeout=30,
                      json={"messages": [{"role": "user", "content": content}], "max_tokens": 3, **extra})


def test_killed_replica_is_skipped_and_requests_succeed_elsewhere(fleet: Fleet) -> None:
    first, second = fleet.start_replica(args=FAST_REPLICA), fleet.start_replica(args=FAST_REPLICA)
    gateway = fleet.start_gateway([first.url, second.url], args=FAST_GATEWAY)
    prompt = "a conversation that lives on one replica " * 50
    owner = ask(gateway.url, prompt).headers["x-gateway-backend"]
    victim, survivor = (first, second) if owner == first.url else (second, first)
    victim.kill()
    for i in range(10):  # right after the kill: pooled connections to the dead replica must not fail requests
        response = ask(gateway.url, prompt if i % 2 else f"other {i} " * 30)
        assert response.status_code == 200, response.text
        assert response.headers["x-gateway-backend"] == survivor.url
    backends = httpx2.get(gateway.url + "/backends", trust_env=False).json()["backends"]
    [described] = [b for b in backends if b["url"] == victim.url]
    assert described["ejected"] or not described["healthy"]  # ejected at its first refusal, down after checks


def test_no_healthy_backend_is_503_with_retry_after(fleet: Fleet) -> None:
    gateway = fleet.start_gateway([f"http://127.0.0.1:{free_port()}"], args=FAST_GATEWAY, ready_path="/health")
    assert httpx2.get(gateway.url + "/ready", trust_env=False).status_code == 503
    named = ask(gateway.url, model="sim-llama-8b")  # it may be what the silent backend serves: come back later
    assert named.status_code == 503 and "retry-after" in named.headers
    assert named.json()["error"]["type"] == "service_unavailable"
    unnamed = ask(gateway.url)
    assert unnamed.status_code == 503 and "retry-after" in unnamed.headers
    assert unnamed.json()["error"]["type"] == "service_unavailable"


def test_silent_backend_times_out_with_504(fleet: Fleet) -> None:
    replica = fleet.start_replica(args=[*FAST_REPLICA, "--hang"])
    gateway = fleet.start_gateway(replica.urls, args=[*FAST_GATEWAY, "--request-timeout-secs", "0.5"])
    started = time.monotonic()
    response = ask(gateway.url)
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "timeout"
    assert time.monotonic() - started < 10
    assert httpx2.get(gateway.url + "/backends", trust_env=False).json()["backends"][0]["in_flight"] == 0


def test_backend_500_is_relayed_and_load_released(fleet: Fleet) -> None:
    replica = fleet.start_replica(args=[*FAST_REPLICA, "--error-rate", "1.0"])
    gateway = fleet.start_gateway(replica.urls, args=FAST_GATEWAY)
    for i in range(MIN_SAMPLES + 2):
        response = ask(gateway.url, f"a long question {i} " * 100)
        assert response.status_code == 500 and "error" in response.json()
    backend = httpx2.get(gateway.url + "/backends", trust_env=False).json()["backends"][0]
    assert backend["in_flight"] == 0
    assert backend["prefill_tokens_per_s"] is None  # instant error answers prefilled nothing


def test_stream_cut_mid_way_ends_with_an_error_event_the_sdk_raises(fleet: Fleet) -> None:
    replica = fleet.start_replica(args=[*FAST_REPLICA, "--drop-after-chunks", "2"])
    gateway = fleet.start_gateway(replica.urls, args=FAST_GATEWAY)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0,
                           http_client=httpx2.Client(trust_env=False, timeout=30))
    with pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(model="sim-llama-8b", max_tokens=20, stream=True,
                                                messages=[{"role": "user", "content": "hello"}]):
            pass
    client.close()
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0,
                                 http_client=httpx2.Client(trust_env=False, timeout=30))
    with pytest.raises(anthropic.APIStatusError, match="broke the exchange"):  # Anthropic's `event: error`
        for _ in claude.messages.create(model="sim-llama-8b", max_tokens=20, stream=True,
                                        messages=[{"role": "user", "content": "hello"}]):
            pass
    claude.close()
    described = httpx2.get(gateway.url + "/backends", trust_env=False).json()["backends"][0]
    assert described["in_flight"] == 0


def test_client_that_goes_away_releases_its_backend(fleet: Fleet) -> None:
    replica = fleet.start_replica(args=["--time-scale", "1.0", "--log-level", "warning"])  # slow: 200 tokens ~ 2 s
    gateway = fleet.start_gateway(replica.urls, args=FAST_GATEWAY)
    with httpx2.Client(trust_env=False, timeout=30) as client, \
            client.stream("POST", gateway.url + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                                "stream": True}) as response:
        next(response.iter_raw())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if httpx2.get(gateway.url + "/backends", trust_env=False).json()["backends"][0]["in_flight"] == 0:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the abandoned request still holds its backend")


def metric(gateway: str, name: str, **labels: str) -> float:
    """The sum of a gateway metric's samples that carry `labels`."""
    total = 0.0
    for line in httpx2.get(gateway + "/metrics", trust_env=False).text.splitlines():
        if line.startswith(name + "{") and all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@contextmanager
def gateway_behind_dropping_proxy(fleet: Fleet, drops: int) -> Iterator[tuple[str, DroppingProxy]]:
    """A gateway whose only backend is a replica behind a proxy that drops the first `drops` requests."""
    replica = fleet.start_replica(args=FAST_REPLICA)
    with dropping_proxy(replica.url, drops) as proxy:
        yield fleet.start_gateway([proxy.url], args=FAST_GATEWAY).url, proxy


def test_connection_closed_before_the_answer_is_retried_on_the_only_backend(fleet: Fleet) -> None:
    with gateway_behind_dropping_proxy(fleet, drops=1) as (gateway, proxy):
        response = ask(gateway)
        assert response.status_code == 200, response.text
        assert proxy.drops_left == 0
        assert metric(gateway, "gateway_upstream_errors_total", kind="broken_before_answer") == 1
        # The client saw one answer, so one request is counted, not a failed attempt beside it.
        assert metric(gateway, "gateway_requests_total") == 1
        assert metric(gateway, "gateway_requests_total", status="200") == 1


def test_backend_that_keeps_closing_the_connection_is_502_not_503(fleet: Fleet) -> None:
    with gateway_behind_dropping_proxy(fleet, drops=100) as (gateway, proxy):
        response = ask(gateway)
        assert response.status_code == 502, response.text
        assert response.json()["error"]["code"] == "upstream_broken"
        assert proxy.drops_left == 97  # the first try and max_retries (2) more
        backend = httpx2.get(gateway + "/backends", trust_env=False).json()["backends"][0]
        assert backend["in_flight"] == 0 and backend["pending_prefill_tokens"] == 0


def test_client_that_leaves_before_a_non_streamed_answer_stops_the_engine(fleet: Fleet) -> None:
    replica = fleet.start_replica(args=["--time-scale", "1.0", "--log-level", "warning"])  # 2,000 tokens ~ 20 s
    gateway = fleet.start_gateway(replica.urls, args=FAST_GATEWAY)
    with pytest.raises(httpx2.ReadTimeout):
        httpx2.post(gateway.url + "/v1/chat/completions", trust_env=False, timeout=1.0,
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000})
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        engine = httpx2.get(replica.url + "/metrics", trust_env=False).text.splitlines()
        [running] = [line for line in engine if line.startswith("sglang:num_running_reqs{")]
        in_flight = httpx2.get(gateway.url + "/backends", trust_env=False).json()["backends"][0]["in_flight"]
        if running.endswith(" 0.0") and in_flight == 0:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the engine still generates for a client that left")
    assert metric(gateway.url, "gateway_requests_total", status="499") == 1


def test_header_value_in_utf8_is_forwarded_and_the_backend_released(fleet: Fleet) -> None:
    replica = fleet.start_replica(args=FAST_REPLICA)
    gateway = fleet.start_gateway(replica.urls, args=FAST_GATEWAY)
    response = httpx2.post(gateway.url + "/v1/chat/completions", trust_env=False, timeout=30,
                           headers=[(b"x-user", "café".encode())],
                           json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3})
    assert response.status_code == 200, response.text
    backend = httpx2.get(gateway.url + "/backends", trust_env=False).json()["backends"][0]
    assert backend["in_flight"] == 0 and backend["pending_prefill_tokens"] == 0
