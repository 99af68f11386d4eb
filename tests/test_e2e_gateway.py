"""The gateway in front of three simulated replicas, over real HTTP with httpx2 and the openai SDK."""

from __future__ import annotations

import httpx2
import openai
import pytest

from simulator.fleet import Fleet

SYSTEM = "You are the support assistant of a bookshop. Answer politely and precisely. " * 40  # ~3,000 chars


def chat(gateway: str, messages: list[dict[str, str]], **extra: object) -> httpx2.Response:
    body = {"model": "sim-llama-8b", "messages": messages, "max_tokens": 4, **extra}
    return httpx2.post(gateway + "/v1/chat/completions", json=body, timeout=30, trust_env=False)


def test_requests_sharing_a_long_prefix_land_on_one_backend(llm_fleet: tuple[Fleet, str, list[str]]) -> None:
    _, gateway, _ = llm_fleet
    backends = set()
    for i in range(8):
        response = chat(gateway, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Q{i}?"}])
        assert response.status_code == 200
        backends.add(response.headers["x-gateway-backend"])
    assert len(backends) == 1
    assert response.headers["x-gateway-route"] == "prefix"
    assert float(response.headers["x-gateway-prefix-match"]) > 0.9
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 500


def test_unrelated_prompts_spread_over_backends(llm_fleet: tuple[Fleet, str, list[str]]) -> None:
    _, gateway, replicas = llm_fleet
    seen = [chat(gateway, [{"role": "user", "content": f"topic {i} " * 200}]).headers["x-gateway-backend"]
            for i in range(9)]
    assert set(seen) == set(replicas)


def test_openai_sdk_sees_cached_tokens_streaming_and_not(llm_fleet: tuple[Fleet, str, list[str]]) -> None:
    _, gateway, _ = llm_fleet
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0,
                           http_client=httpx2.Client(trust_env=False, timeout=30))
    messages = [{"role": "system", "content": "Streaming check. " + SYSTEM}, {"role": "user", "content": "Hi"}]
    first = client.chat.completions.create(model="sim-llama-8b", messages=messages, max_tokens=5)
    assert first.choices[0].message.content
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(client.chat.completions.create(model="sim-llama-8b", messages=messages, max_tokens=5,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens > 0
    completion = client.completions.create(model="sim-llama-8b", prompt=SYSTEM, max_tokens=3)
    assert completion.choices[0].text
    client.close()


def test_gateway_metrics_count_the_cached_tokens_backends_report(llm_fleet: tuple[Fleet, str, list[str]]) -> None:
    _, gateway, _ = llm_fleet
    for question in ("a", "b"):
        chat(gateway, [{"role": "system", "content": "Metrics. " + SYSTEM}, {"role": "user", "content": question}],
             stream=True, stream_options={"include_usage": True})
    metrics = httpx2.get(gateway + "/metrics", trust_env=False).text
    cached = sum(float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("gateway_cached_tokens_total{"))
    predicted = sum(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("gateway_predicted_cached_tokens_total{"))
    assert cached > 500 and predicted > 500
    assert 'gateway_backend_healthy{backend="' in metrics
    assert "gateway_upstream_ttfb_seconds_bucket" in metrics


def test_sglang_generate_endpoint_is_relayed(llm_fleet: tuple[Fleet, str, list[str]]) -> None:
    _, gateway, _ = llm_fleet
    body = {"text": SYSTEM, "sampling_params": {"max_new_tokens": 3}}
    for _ in range(2):
        response = httpx2.post(gateway + "/generate", json=body, timeout=30, trust_env=False)
    assert response.status_code == 200
    assert response.json()["meta_info"]["cached_tokens"] > 0


def test_request_id_is_propagated_or_generated(llm_fleet: tuple[Fleet, str, list[str]]) -> None:
    _, gateway, _ = llm_fleet
    given = httpx2.post(gateway + "/v1/chat/completions", headers={"x-request-id": "abc-123"}, timeout=30,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, trust_env=False)
    assert given.headers["x-request-id"] == "abc-123"
    generated = chat(gateway, [{"role": "user", "content": "hi"}])
    assert len(generated.headers["x-request-id"]) >= 16


@pytest.mark.parametrize(("body", "status", "fragment"), [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"model": "sim-llama-8b"}', 400, "'messages' is a required property"),
    (b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}', 404, "sim-llama-8b"),
])
def test_bad_requests_get_openai_shaped_errors(llm_fleet: tuple[Fleet, str, list[str]], body: bytes, status: int,
                                               fragment: str) -> None:
    _, gateway, _ = llm_fleet
    response = httpx2.post(gateway + "/v1/chat/completions", content=body, trust_env=False,
                          headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"


def test_oversized_body_is_413(fleet: Fleet, llm_fleet: tuple[Fleet, str, list[str]]) -> None:
    _, _, replicas = llm_fleet
    gateway = fleet.start_gateway(replicas, args=["--max-body-bytes", "2048", "--log-level", "warning"])
    response = chat(gateway.url, [{"role": "user", "content": "x" * 5000}])
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_operational_endpoints(llm_fleet: tuple[Fleet, str, list[str]]) -> None:
    _, gateway, replicas = llm_fleet
    assert httpx2.get(gateway + "/health", trust_env=False).status_code == 200
    assert httpx2.get(gateway + "/ready", trust_env=False).json()["ready"] is True
    described = httpx2.get(gateway + "/backends", trust_env=False).json()
    assert described["policy"] == "prefix_aware"
    assert [b["url"] for b in described["backends"]] == replicas
    assert all(b["healthy"] and b["model"] == "sim-llama-8b" and b["capacity_tokens"] for b in described["backends"])
    # The index models 85% of the engine's KV pool (--index-kv-share); 64-character blocks of 4-character tokens.
    assert all(b["index_capacity_blocks"] == int(b["capacity_tokens"] * 0.85 * 4) // 64 for b in described["backends"])
    assert [m["id"] for m in httpx2.get(gateway + "/v1/models", trust_env=False).json()["data"]] == ["sim-llama-8b"]
    missing = httpx2.get(gateway + "/v2/nothing", trust_env=False)
    assert missing.status_code == 404 and "error" in missing.json()
