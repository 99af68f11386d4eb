"""Failing replicas: skipped, retried elsewhere, and reported in OpenAI's error shape, never hung."""

from __future__ import annotations

import time

import httpx2
import openai
import pytest

from loadtest.fleet import Fleet, free_port
from tests.conftest import FAST_GATEWAY, FAST_REPLICA


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
    assert [b["healthy"] for b in backends if b["url"] == victim.url] == [False]


def test_no_healthy_backend_is_503_with_retry_after(fleet: Fleet) -> None:
    gateway = fleet.start_gateway([f"http://127.0.0.1:{free_port()}"], args=FAST_GATEWAY, ready_path="/health")
    assert httpx2.get(gateway.url + "/ready", trust_env=False).status_code == 503
    response = ask(gateway.url, model="sim-llama-8b")
    assert response.status_code in (404, 503)  # no model known yet, or known but down
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
    response = ask(gateway.url)
    assert response.status_code == 500 and "error" in response.json()
    assert httpx2.get(gateway.url + "/backends", trust_env=False).json()["backends"][0]["in_flight"] == 0


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
    described = httpx2.get(gateway.url + "/backends", trust_env=False).json()["backends"][0]
    assert described["in_flight"] == 0


def test_client_that_goes_away_releases_its_backend(fleet: Fleet) -> None:
    replica = fleet.start_replica(args=["--time-scale", "1.0", "--log-level", "warning"])  # slow: 200 tokens ~ 2 s
    gateway = fleet.start_gateway(replica.urls, args=FAST_GATEWAY)
    with httpx2.Client(trust_env=False, timeout=30) as client:
        with client.stream("POST", gateway.url + "/v1/chat/completions",
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
