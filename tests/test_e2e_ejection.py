"""Outlier ejection with real processes: a failing or hung replica loses its traffic, a client's 4xx never costs a
replica anything."""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx2

from simulator.fleet import Fleet
from tests.conftest import FAST_GATEWAY, FAST_REPLICA
from tests.test_e2e_failures import ask, metric


def described(gateway: str, url: str) -> dict[str, Any]:
    backends = httpx2.get(gateway + "/backends", trust_env=False).json()["backends"]
    [backend] = [b for b in backends if b["url"] == url]
    return backend


def stream(gateway: str, content: str) -> httpx2.Response:
    return httpx2.post(gateway + "/v1/chat/completions", trust_env=False, timeout=30,
                       json={"messages": [{"role": "user", "content": content}], "max_tokens": 3, "stream": True})


def test_replica_failing_half_its_requests_gets_clearly_less_traffic(fleet: Fleet) -> None:
    healthy = fleet.start_replicas(2, args=FAST_REPLICA)
    failing = fleet.start_replica(args=[*FAST_REPLICA, "--error-rate", "0.5"])
    gateway = fleet.start_gateway([*healthy.urls, *failing.urls], args=[
        *FAST_GATEWAY, "--outlier-consecutive-failures", "2", "--outlier-base-ejection-secs", "3"])
    with ThreadPoolExecutor(8) as pool:  # concurrent, so a backend that fails fast would look the least loaded
        responses = list(pool.map(lambda i: ask(gateway.url, f"question {i} " * 40), range(240)))
    served = collections.Counter(r.headers["x-gateway-backend"] for r in responses)
    assert served[failing.url] < 0.5 * min(served[url] for url in healthy.urls), served
    assert metric(gateway.url, "gateway_backend_ejections_total", backend=failing.url, cause="5xx") >= 1
    assert all(metric(gateway.url, "gateway_backend_ejections_total", backend=url) == 0 for url in healthy.urls)
    assert all(r.status_code == 200 for r in responses if r.headers["x-gateway-backend"] != failing.url)


def test_hung_replica_is_ejected_after_the_first_byte_timeout_and_requests_go_elsewhere(fleet: Fleet) -> None:
    hung = fleet.start_replica(args=[*FAST_REPLICA, "--hang"])  # /health answers, generation never starts
    healthy = fleet.start_replica(args=FAST_REPLICA)
    gateway = fleet.start_gateway([hung.url, healthy.url], args=[*FAST_GATEWAY, "--first-byte-timeout-secs", "2"])
    statuses = collections.Counter(stream(gateway.url, f"conversation {i} " * 30).status_code for i in range(20))
    assert statuses[504] <= 1 and statuses[200] >= 19, statuses  # one request finds it hung, no other does
    backend = described(gateway.url, hung.url)
    assert backend["healthy"] and backend["ejected"] and backend["in_flight"] == 0
    assert backend["outlier"]["cause"] == "first_byte_timeout"
    assert metric(gateway.url, "gateway_backend_ejected", backend=hung.url) == 1


def test_client_errors_never_eject_and_a_rejected_giant_prompt_keeps_the_conversations_routes(fleet: Fleet) -> None:
    replicas = fleet.start_replicas(2, args=[*FAST_REPLICA, "--context-length", "4000"])
    # Indexes of 1,562 blocks (100,000 characters), so that a pasted document of 30,000 is a giant.
    gateway = fleet.start_gateway(replicas.urls, args=[*FAST_GATEWAY, "--outlier-consecutive-failures", "2",
                                                       "--max-tree-size", "100000"])
    conversations = [f"conversation {i} has a long history " * 60 for i in range(6)]
    owners = [ask(gateway.url, history).headers["x-gateway-backend"] for history in conversations]
    for i in range(8):
        too_long = ask(gateway.url, f"enormous pasted document {i} " * 1_100)  # far over the context
        assert too_long.status_code == 400, too_long.text
    for url in replicas.urls:
        assert not described(gateway.url, url)["ejected"]
    for history, owner in zip(conversations, owners, strict=True):
        follow_up = ask(gateway.url, history + " and one more question")
        assert follow_up.status_code == 200
        assert follow_up.headers["x-gateway-backend"] == owner
        assert float(follow_up.headers["x-gateway-prefix-match"]) > 0.9
