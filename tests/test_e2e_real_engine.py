"""The gateway in front of two real llama.cpp servers (CPU, a tiny generated model): what users will trust.

Needs `bash scripts/real-engine/setup.sh`; skipped with that hint otherwise.
"""

from __future__ import annotations

import httpx2
import openai
import pytest

from simulator.fleet import Fleet
from tests.llama_fleet import llama_fleet

pytestmark = pytest.mark.real_engine

SYSTEM = "You are a terse assistant for a hardware store. Answer in one short sentence. " * 6
FAST = ["--health-check-interval-secs", "0.2", "--health-check-timeout-secs", "2", "--log-level", "warning"]


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                         http_client=httpx2.Client(trust_env=False, timeout=60))


def cached_total(gateway: str) -> float:
    metrics = httpx2.get(gateway + "/metrics", trust_env=False).text
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("gateway_cached_tokens_total{"))


def test_second_turn_lands_on_the_same_engine_and_is_served_from_its_prompt_cache(fleet: Fleet) -> None:
    # One slot per engine: the slot keeps the last prompt, so only the gateway's choice of engine decides
    # whether the second turn is served from cache (with several slots, llama-server's own slot choice joins in).
    with llama_fleet(2, ctx_size=4096, parallel=1) as servers:
        gateway = fleet.start_gateway([s.url for s in servers], args=FAST)
        described = httpx2.get(gateway.url + "/backends", trust_env=False).json()["backends"]
        assert {b["engine"] for b in described} == {"llama.cpp"}
        assert {b["model"] for b in described} == {"tiny-llama"} and all(b["capacity_tokens"] for b in described)
        client = client_for(gateway.url)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Do you sell hammers?"}]
        first = client.chat.completions.with_raw_response.create(model="tiny-llama", messages=messages,
                                                                 max_tokens=8)
        answer = first.parse().choices[0].message.content or ""
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And nails?"}]
        chunks = list(client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=8,
                                                     stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        reused = usage.prompt_tokens_details.cached_tokens or 0
        assert reused > 50  # the engine's own report: the first turn's prompt came from its cache
        assert cached_total(gateway.url) == reused  # the gateway's metric agrees with the engine
        third = client.chat.completions.with_raw_response.create(model="tiny-llama", messages=messages,
                                                                 max_tokens=4)
        assert third.headers["x-gateway-backend"] == first.headers["x-gateway-backend"]
        client.close()


def test_killed_engine_is_skipped(fleet: Fleet) -> None:
    with llama_fleet(2) as servers:
        gateway = fleet.start_gateway([s.url for s in servers], args=FAST)
        servers[0].proc.kill()
        servers[0].proc.wait(timeout=10)
        client = client_for(gateway.url)
        for i in range(4):
            reply = client.chat.completions.with_raw_response.create(
                model="tiny-llama", max_tokens=2, messages=[{"role": "user", "content": f"question {i}"}])
            assert reply.headers["x-gateway-backend"] == servers[1].url
        client.close()
