"""The simulated replica behind the real sglang-router 0.3.2: it must register the workers and relay requests.

What the router sends, observed with a capturing worker: at registration `GET /health`, `GET /server_info`,
`GET /model_info`; per chat request a re-serialised body with `max_tokens` renamed `max_completion_tokens`
and SGLang extras added (`logprobs`, `no_stop_trim`, `ignore_eos`, `continue_final_message`,
`skip_special_tokens`, `separate_reasoning`, `stream_reasoning`, `return_hidden_states`); for `/generate`
`"model": null` plus `return_text_in_logprobs`, `log_metrics`, `background`, `no_logs`, `return_bytes`,
`return_entropy`. It answers `/v1/models` itself and refuses `stream_options` without `stream`.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator

import httpx2
import openai
import pytest

from simulator.fleet import Fleet, Process

pytestmark = [
    pytest.mark.peer,
    pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                       reason="sglang-router is not installed (pip install -e '.[bench]')"),
]


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[Process, Process]]:
    fleet = Fleet()
    try:
        replicas = fleet.start_replicas(2, args=["--time-scale", "0.001"])
        router = fleet.start_sglang_router(replicas.urls, policy="round_robin")
        yield replicas, router
    finally:
        fleet.stop()


@pytest.fixture()
def client(fleet: tuple[Process, Process]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=fleet[1].url + "/v1", api_key="x", max_retries=0, timeout=30,
                       http_client=openai.DefaultHttpxClient(trust_env=False)) as client:
        yield client


def prompt_tokens_served(url: str) -> float:
    with httpx2.Client(trust_env=False, timeout=10) as http:
        text = http.get(url + "/metrics").text
    match = re.search(r"^sglang:prompt_tokens_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    assert match is not None
    return float(match.group(1))


def test_chat_through_sglang_router_succeeds_on_both_replicas(fleet: tuple[Process, Process],
                                                             client: openai.OpenAI) -> None:
    for i in range(4):
        reply = client.chat.completions.create(model="sim-llama-8b", max_tokens=5,
                                               messages=[{"role": "user", "content": f"question {i}"}])
        assert len((reply.choices[0].message.content or "").split()) == 5
        assert reply.usage is not None and reply.usage.completion_tokens == 5
    replicas = fleet[0]
    assert all(prompt_tokens_served(url) > 0 for url in replicas.urls), "round robin should use both"


def test_streaming_chat_through_sglang_router(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="sim-llama-8b", max_tokens=4, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 4
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_completions_and_generate_through_sglang_router(fleet: tuple[Process, Process],
                                                        client: openai.OpenAI) -> None:
    reply = client.completions.create(model="sim-llama-8b", prompt="Once upon a time", max_tokens=3)
    assert len(reply.choices[0].text.split()) == 3
    with httpx2.Client(trust_env=False, timeout=30) as http:
        response = http.post(fleet[1].url + "/generate",
                             json={"text": "native", "sampling_params": {"max_new_tokens": 2}})
    assert response.status_code == 200 and response.json()["meta_info"]["completion_tokens"] == 2
