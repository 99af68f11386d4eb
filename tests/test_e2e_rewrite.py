"""Prompt rewriting through the real gateway: a random ID at the prompt start no longer kills cache hits."""

from __future__ import annotations

import json
import uuid

import httpx2

from simulator.fleet import Fleet
from tests.capture_backend import capture_backend
from tests.conftest import FAST_GATEWAY

SYSTEM = "You are the billing assistant. Follow the policy below exactly. " * 40


def ask(gateway: str, request_id: str, question: str, headers: dict[str, str] | None = None) -> httpx2.Response:
    messages = [{"role": "system", "content": f"Request ID: {request_id}\n{SYSTEM}"},
                {"role": "user", "content": question}]
    return httpx2.post(gateway + "/v1/chat/completions", trust_env=False, timeout=30, headers=headers or {},
                      json={"model": "sim-llama-8b", "messages": messages, "max_tokens": 3})


def cached(response: httpx2.Response) -> int:
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_moved_request_id_keeps_affinity_and_cache_hits(llm_fleet: tuple[Fleet, str, list[str]]) -> None:
    _, gateway, _ = llm_fleet
    first = ask(gateway, str(uuid.uuid4()), "How do refunds work?")
    second = ask(gateway, str(uuid.uuid4()), "And exchanges?")
    assert second.headers["x-gateway-rewritten-spans"] == "1"
    assert second.headers["x-gateway-backend"] == first.headers["x-gateway-backend"]
    assert cached(second) > 500
    metrics = httpx2.get(gateway + "/metrics", trust_env=False).text
    assert 'gateway_rewrite_spans_total{action="move",rule="id_line"}' in metrics


def test_opted_out_request_is_sent_as_it_came(llm_fleet: tuple[Fleet, str, list[str]]) -> None:
    _, gateway, _ = llm_fleet
    off = {"x-gateway-rewrite": "off"}
    ask(gateway, str(uuid.uuid4()), "warm", off)
    response = ask(gateway, str(uuid.uuid4()), "again", off)
    assert response.headers["x-gateway-rewritten-spans"] == "0"
    assert cached(response) < 20  # the unique ID is the first thing the engine sees


def test_backend_receives_the_rewritten_prompt_and_the_rest_untouched(fleet: Fleet) -> None:
    with capture_backend("sim-llama-8b") as (url, captured):
        gateway = fleet.start_gateway([url], args=FAST_GATEWAY)
        request_id = str(uuid.uuid4())
        httpx2.post(gateway.url + "/v1/chat/completions", trust_env=False, timeout=30,
                   json={"messages": [{"role": "system", "content": f"Request ID: {request_id}\nBe brief."},
                                      {"role": "user", "content": "Hi"}], "temperature": 0.25, "extra": [1]})
    sent = json.loads(captured.bodies[0])
    assert sent["messages"][0]["content"] == "Be brief."
    assert sent["messages"][1]["content"].startswith("Hi\n\n[prefix-gateway: moved from prompt start]")
    assert request_id in sent["messages"][1]["content"]
    assert sent["temperature"] == 0.25 and sent["extra"] == [1]
