"""Two simulated replicas of one base model serving different LoRA adapters behind one gateway: adapter requests go
only where the adapter is served, and a prompt cached under one adapter is predicted (and found) cached under no
other."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx2
import pytest

from simulator.fleet import running_fleet
from tests.conftest import FAST_GATEWAY, FAST_REPLICA
from tests.policy_fixtures import text

BASE = "sim-llm"


@pytest.fixture(scope="module")
def adapters() -> Iterator[tuple[str, str, str]]:
    """(gateway URL, the replica serving sql and chat, the one serving math)."""
    with running_fleet() as fleet:
        first = fleet.start_replicas(1, args=[*FAST_REPLICA, "--model", BASE, "--lora-adapters", "sql,chat"],
                                     name="sql-chat")
        second = fleet.start_replicas(1, args=[*FAST_REPLICA, "--model", BASE, "--lora-adapters", "math"],
                                      name="math")
        gateway = fleet.start_gateway(first.urls + second.urls, args=FAST_GATEWAY)
        yield gateway.url, first.urls[0], second.urls[0]


def chat(url: str, prompt: str, **fields: Any) -> httpx2.Response:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1, **fields}
    response = httpx2.post(url + "/v1/chat/completions", json=body, trust_env=False, timeout=30)
    assert response.status_code == 200, response.text
    return response


def cached_tokens(response: httpx2.Response) -> int:
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_models_lists_the_base_model_and_every_adapter(adapters: tuple[str, str, str]) -> None:
    gateway, _, _ = adapters
    listed = httpx2.get(gateway + "/v1/models", trust_env=False).json()["data"]
    assert [(model["id"], model["parent"]) for model in listed] == [
        ("chat", BASE), ("math", BASE), (BASE, None), ("sql", BASE)]


def test_adapter_requests_go_only_to_the_replica_serving_the_adapter(adapters: tuple[str, str, str]) -> None:
    gateway, sql_chat, math = adapters
    for i in range(3):
        prompt = text(f"question {i}", 300)
        assert chat(gateway, prompt, model="sql").headers["x-gateway-backend"] == sql_chat
        assert chat(gateway, prompt, model="math").headers["x-gateway-backend"] == math
        assert chat(gateway, prompt, model=f"{BASE}:chat").headers["x-gateway-backend"] == sql_chat  # SGLang's
        assert chat(gateway, prompt, model=BASE, lora_path="math").headers["x-gateway-backend"] == math
    served = {chat(gateway, text(f"base {i}", 300), model=BASE).headers["x-gateway-backend"] for i in range(6)}
    assert served <= {sql_chat, math}


def test_a_prompt_cached_under_one_adapter_is_no_hit_under_another(adapters: tuple[str, str, str]) -> None:
    gateway, _, _ = adapters
    prompt = text("You are a careful analyst. Answer briefly.", 2000)
    first = chat(gateway, prompt, model="sql")
    again = chat(gateway, prompt, model="sql")
    assert float(first.headers["x-gateway-prefix-match"]) == 0.0 and cached_tokens(first) == 0
    assert float(again.headers["x-gateway-prefix-match"]) > 0.9 and cached_tokens(again) > 400
    other = chat(gateway, prompt, model="chat")  # the same replica, another adapter: cached apart
    assert other.headers["x-gateway-backend"] == first.headers["x-gateway-backend"]
    assert float(other.headers["x-gateway-prefix-match"]) == 0.0 and cached_tokens(other) == 0
    base = chat(gateway, prompt, model=BASE)
    assert float(base.headers["x-gateway-prefix-match"]) == 0.0 and cached_tokens(base) == 0


def test_an_unknown_model_is_404_at_the_gateway_and_at_the_replica(adapters: tuple[str, str, str]) -> None:
    gateway, sql_chat, _ = adapters
    body = {"model": "poetry", "messages": [{"role": "user", "content": "x"}]}
    through = httpx2.post(gateway + "/v1/chat/completions", json=body, trust_env=False, timeout=30)
    assert through.status_code == 404 and "chat, math, sim-llm, sql" in through.json()["error"]["message"]
    direct = httpx2.post(sql_chat + "/v1/chat/completions", json=body, trust_env=False, timeout=30)
    assert direct.status_code == 404
    assert direct.json()["error"] == {"message": "The model `poetry` does not exist.", "type": "NotFoundError",
                                      "param": "model", "code": 404}
