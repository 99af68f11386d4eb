"""An LLM pool and an embedding pool behind one gateway: requests are routed by model."""

from __future__ import annotations

from collections.abc import Iterator

import httpx2
import openai
import pytest

from simulator.fleet import Fleet, running_fleet
from tests.conftest import FAST_GATEWAY, FAST_REPLICA


@pytest.fixture(scope="module")
def two_pools() -> Iterator[tuple[str, list[str], list[str]]]:
    with running_fleet() as fleet:
        llms = fleet.start_replicas(2, args=[*FAST_REPLICA, "--model", "sim-llm"])
        embedders = fleet.start_replicas(1, args=[*FAST_REPLICA, "--embedding", "--model", "sim-embed"],
                                         name="embedder")
        gateway = fleet.start_gateway(llms.urls + embedders.urls, args=FAST_GATEWAY)
        yield gateway.url, llms.urls, embedders.urls


def test_models_lists_the_union_of_both_pools(two_pools: tuple[str, list[str], list[str]]) -> None:
    gateway, _, _ = two_pools
    listed = httpx2.get(gateway + "/v1/models", trust_env=False).json()
    assert [model["id"] for model in listed["data"]] == ["sim-embed", "sim-llm"]


def test_requests_go_only_to_backends_serving_their_model(two_pools: tuple[str, list[str], list[str]]) -> None:
    gateway, llms, embedders = two_pools
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0,
                           http_client=httpx2.Client(trust_env=False, timeout=30))
    for i in range(4):
        chat = client.chat.completions.with_raw_response.create(
            model="sim-llm", max_tokens=2, messages=[{"role": "user", "content": f"hello {i} " * 30}])
        assert chat.headers["x-gateway-backend"] in llms
        embedding = client.embeddings.with_raw_response.create(model="sim-embed", input=f"text {i}")
        assert embedding.headers["x-gateway-backend"] in embedders
        assert embedding.parse().data[0].embedding
    client.close()


def test_request_without_model_needs_one_when_several_are_served(
        two_pools: tuple[str, list[str], list[str]]) -> None:
    gateway, _, _ = two_pools
    response = httpx2.post(gateway + "/v1/chat/completions", trust_env=False,
                          json={"messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 400
    assert "sim-embed" in response.json()["error"]["message"]


def test_unknown_model_is_404_listing_available_ones(two_pools: tuple[str, list[str], list[str]]) -> None:
    gateway, _, _ = two_pools
    response = httpx2.post(gateway + "/v1/embeddings", trust_env=False, json={"model": "nope", "input": "x"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and "sim-embed, sim-llm" in error["message"]


def test_request_without_model_goes_to_the_only_model(fleet: Fleet) -> None:
    replicas = fleet.start_replicas(1, args=FAST_REPLICA)
    gateway = fleet.start_gateway(replicas.urls, args=FAST_GATEWAY)
    response = httpx2.post(gateway.url + "/v1/chat/completions", trust_env=False, timeout=30,
                          json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    assert response.status_code == 200
