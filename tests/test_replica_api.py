"""The simulated replica over HTTP, as real subprocesses on loopback, parsed by the openai SDK."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator

import httpx2
import openai
import pytest

from simulator.fleet import Fleet, Process, base_url, free_port, start_process

MakeClient = Callable[[str], openai.OpenAI]
FAST = ["--time-scale", "0.001"]
LONG_SYSTEM = "You are a careful assistant for the prefix gateway project. " * 30


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    fleet = Fleet()
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def replicas(fleet: Fleet) -> Process:
    """Two replicas from one process: [0] for plain traffic, [1] for fault injection."""
    return fleet.start_replicas(2, args=[*FAST, "--model", "sim-test", "--kv-capacity-tokens", "200000"])


@pytest.fixture(scope="module")
def embedder(fleet: Fleet) -> Process:
    # Unhealthy from the start: ready is judged by /v1/models, the probes must say 503.
    port = free_port()
    argv = [sys.executable, "-m", "simulator.replica", "--port", str(port), "--embedding", *FAST,
            "--model", "sim-embed", "--embedding-dim", "64", "--unhealthy-for-s", "600"]
    process = start_process("embedder", argv, [base_url(port)], ready_path="/v1/models", timeout_s=30)
    fleet.processes.append(process)
    return process


@pytest.fixture()
def http() -> Iterator[httpx2.Client]:
    with httpx2.Client(trust_env=False, timeout=20) as client:
        yield client


@pytest.fixture()
def sdk() -> Iterator[MakeClient]:
    """Makes openai clients for a replica URL, all closed after the test (open sockets would warn)."""
    clients: list[openai.OpenAI] = []

    def make(url: str) -> openai.OpenAI:
        clients.append(openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=20,
                                     http_client=openai.DefaultHttpxClient(trust_env=False)))
        return clients[-1]

    yield make
    for client in clients:
        client.close()


@pytest.fixture()
def faulty(replicas: Process, http: httpx2.Client) -> Iterator[str]:
    url = replicas.urls[1]
    yield url
    clear = {"error_rate": 0, "latency_ms": 0, "hang": False, "drop_after_chunks": None, "unhealthy_for_s": 0}
    assert http.post(url + "/control/faults", json=clear).status_code == 200


def test_chat_completion_parses_and_has_exact_length(sdk: MakeClient, replicas: Process) -> None:
    client = sdk(replicas.url)
    reply = client.chat.completions.create(model="sim-test", max_tokens=12,
                                           messages=[{"role": "user", "content": "Say something."}])
    assert reply.object == "chat.completion" and reply.model == "sim-test"
    assert reply.choices[0].message.role == "assistant"
    assert len((reply.choices[0].message.content or "").split()) == 12
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12


def test_repeated_long_prompt_reports_cached_tokens(sdk: MakeClient, replicas: Process) -> None:
    client = sdk(replicas.url)
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "cache test question"}]
    first = client.chat.completions.create(model="sim-test", messages=messages, max_completion_tokens=2)
    second = client.chat.completions.create(model="sim-test", messages=messages, max_completion_tokens=2)
    assert first.usage and first.usage.prompt_tokens_details and second.usage and second.usage.prompt_tokens_details
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 400
    assert first.choices[0].message.content == second.choices[0].message.content


def test_chat_stream_has_one_chunk_per_token_then_finish_and_usage(sdk: MakeClient, replicas: Process) -> None:
    stream = sdk(replicas.url).chat.completions.create(
        model="sim-test", max_tokens=5, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "stream please"}])
    chunks = list(stream)
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(contents) == 5
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


def test_completions_stream_and_not(sdk: MakeClient, replicas: Process) -> None:
    client = sdk(replicas.url)
    reply = client.completions.create(model="sim-test", prompt="Once upon a time", max_tokens=6)
    assert reply.object == "text_completion" and len(reply.choices[0].text.split()) == 6
    pieces = [c.choices[0].text for c in client.completions.create(
        model="sim-test", prompt="Once upon a time", max_tokens=6, stream=True) if c.choices]
    assert "".join(pieces) == reply.choices[0].text


def test_generate_native_reports_meta_info(replicas: Process, http: httpx2.Client) -> None:
    body = {"text": "native prompt " * 20, "sampling_params": {"max_new_tokens": 4}, "model": None,
            "no_logs": False}
    first = http.post(replicas.url + "/generate", json=body).json()
    again = http.post(replicas.url + "/generate", json=body).json()
    meta = again["meta_info"]
    assert meta["completion_tokens"] == 4 and meta["prompt_tokens"] == 70
    assert first["meta_info"]["cached_tokens"] == 0 and meta["cached_tokens"] == 64
    assert meta["finish_reason"] == {"type": "length", "length": 4} and meta["e2e_latency"] >= 0
    batch = http.post(replicas.url + "/generate", json={"input_ids": [[1, 2, 3], [4, 5]]}).json()
    assert [item["meta_info"]["completion_tokens"] for item in batch] == [16, 16]


def test_generate_stream_repeats_cumulative_text(replicas: Process, http: httpx2.Client) -> None:
    body = {"text": "stream natively", "sampling_params": {"max_new_tokens": 3}, "stream": True}
    with http.stream("POST", replicas.url + "/generate", json=body) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert len(events) == 3 and events[-1]["text"].startswith(events[0]["text"])
    assert events[-1]["meta_info"]["finish_reason"]["length"] == 3


def test_info_endpoints_have_what_routers_read(sdk: MakeClient, replicas: Process, http: httpx2.Client) -> None:
    url = replicas.url
    for path in ("/server_info", "/get_server_info"):
        info = http.get(url + path).json()
        assert info["served_model_name"] == info["model_path"] == "sim-test"
        assert info["max_total_num_tokens"] == 200000 and info["tp_size"] == 1 and info["dp_size"] == 1
        assert info["is_embedding"] is False and isinstance(info["max_running_requests"], int)
    for path in ("/model_info", "/get_model_info"):
        assert http.get(url + path).json()["is_generation"] is True
    [load] = http.get(url + "/get_load").json()
    assert set(load) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    models = sdk(url).models.list()
    assert [m.id for m in models.data] == ["sim-test"]
    response = http.get(url + "/health")
    assert response.status_code == 200 and response.headers["x-replica-id"] == url.removeprefix("http://")


def test_metrics_use_sglang_names_with_model_label(replicas: Process, http: httpx2.Client) -> None:
    text = http.get(replicas.url + "/metrics").text
    for name in ("num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate", "prompt_tokens_total",
                 "generation_tokens_total", "cached_tokens_total", "num_requests_total"):
        assert f'sglang:{name}{{model_name="sim-test"}}' in text


def test_flush_cache_makes_the_next_request_miss(replicas: Process, http: httpx2.Client) -> None:
    body = {"text": "flush me " * 40, "sampling_params": {"max_new_tokens": 1}}
    http.post(replicas.url + "/generate", json=body)
    assert http.post(replicas.url + "/flush_cache").status_code == 200
    assert http.post(replicas.url + "/generate", json=body).json()["meta_info"]["cached_tokens"] == 0


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b'{"model": "m"}', "messages"),
    (b'{"messages": "hi"}', "messages"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 2}', "n"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "messages"),
])
def test_bad_chat_requests_get_400_in_openai_shape(replicas: Process, http: httpx2.Client, body: bytes,
                                                   param: str | None) -> None:
    response = http.post(replicas.url + "/v1/chat/completions", content=body,
                         headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param


def test_unknown_fields_and_sglang_extras_are_ignored(replicas: Process, http: httpx2.Client) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2, "no_stop_trim": False,
            "skip_special_tokens": True, "separate_reasoning": True, "rid": "r1", "ignore_eos": False,
            "logprobs": False, "stream_reasoning": True, "return_hidden_states": False, "surprise": {"a": 1}}
    assert http.post(replicas.url + "/v1/chat/completions", json=body).status_code == 200


def test_embeddings_are_deterministic_unit_vectors(sdk: MakeClient, embedder: Process, http: httpx2.Client) -> None:
    client = sdk(embedder.url)
    first = client.embeddings.create(model="sim-embed", input=["alpha", "beta"])          # base64 by default
    floats = client.embeddings.create(model="sim-embed", input="alpha", encoding_format="float")
    a, b = first.data[0].embedding, first.data[1].embedding
    assert len(a) == 64 and abs(sum(x * x for x in a) - 1.0) < 1e-4
    assert a != b and floats.data[0].embedding == pytest.approx(a, abs=1e-6)
    assert first.usage.prompt_tokens == 3             # ceil(5 / 4) + ceil(4 / 4)
    chat = http.post(embedder.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "model"


def test_unhealthy_for_flag_makes_probes_503(embedder: Process, http: httpx2.Client) -> None:
    for path in ("/health", "/health_generate", "/ready"):
        assert http.get(embedder.url + path).status_code == 503
    assert http.get(embedder.url + "/control/faults").json()["unhealthy_remaining_s"] > 500


def test_error_rate_one_answers_500_in_openai_shape(sdk: MakeClient, faulty: str, http: httpx2.Client) -> None:
    assert http.post(faulty + "/control/faults", json={"error_rate": 1.0}).json()["error_rate"] == 1.0
    with pytest.raises(openai.InternalServerError) as raised:
        sdk(faulty).chat.completions.create(model="sim-test", messages=[{"role": "user", "content": "x"}])
    assert raised.value.status_code == 500
    assert set(raised.value.response.json()["error"]) == {"message", "type", "param", "code"}


def test_unhealthy_for_set_at_runtime(faulty: str, http: httpx2.Client) -> None:
    http.post(faulty + "/control/faults", json={"unhealthy_for_s": 60})
    assert http.get(faulty + "/health").status_code == 503
    http.post(faulty + "/control/faults", json={"unhealthy_for_s": 0})
    assert http.get(faulty + "/health").status_code == 200


def test_drop_after_chunks_cuts_the_stream(faulty: str) -> None:
    with httpx2.Client(trust_env=False, timeout=20) as http:
        http.post(faulty + "/control/faults", json={"drop_after_chunks": 2})
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10, "stream": True}
        received: list[str] = []
        with pytest.raises(httpx2.RemoteProtocolError), \
                http.stream("POST", faulty + "/v1/chat/completions", json=body) as response:
            received.extend(line for line in response.iter_lines() if line)
    assert len(received) == 2


def test_hang_holds_requests_until_cleared(faulty: str, http: httpx2.Client) -> None:
    http.post(faulty + "/control/faults", json={"hang": True})
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    with pytest.raises(httpx2.ReadTimeout):
        http.post(faulty + "/v1/chat/completions", json=body, timeout=0.5)
    assert http.get(faulty + "/health").status_code == 200
    http.post(faulty + "/control/faults", json={"hang": False})
    assert http.post(faulty + "/v1/chat/completions", json=body).status_code == 200


def test_bad_fault_settings_get_400(faulty: str, http: httpx2.Client) -> None:
    assert http.post(faulty + "/control/faults", json={"error_rate": 2}).status_code == 400
    assert http.post(faulty + "/control/faults", json={"explode": True}).status_code == 400
    assert http.post(faulty + "/control/faults", json={"hang": "yes"}).status_code == 400


def test_latency_fault_delays_the_response(faulty: str, http: httpx2.Client) -> None:
    http.post(faulty + "/control/faults", json={"latency_ms": 300})
    response = http.post(faulty + "/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    assert response.status_code == 200 and response.elapsed.total_seconds() >= 0.3


def test_help_documents_every_flag() -> None:
    import subprocess

    out = subprocess.run([sys.executable, "-m", "simulator.replica", "--help"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    out = " ".join(out.split())  # argparse wraps lines at the terminal width
    for flag in ("--port ", "--ports", "--host", "--model", "--kv-capacity-tokens", "--time-scale",
                 "--max-running-requests", "--embedding", "--error-rate", "--latency-ms", "--hang",
                 "--drop-after-chunks", "--unhealthy-for-s", "--log-level"):
        assert flag in out
    assert "(default: 400000)" in out and "(default: 1.0)" in out


def test_replicas_of_one_process_take_one_kv_capacity_each_or_all_the_same() -> None:
    from simulator.replica import build_parser, configs_from_args

    def capacities(*argv: str) -> list[int]:
        return [c.engine.kv_capacity_tokens for c in configs_from_args(build_parser().parse_args(list(argv)))]
    assert capacities("--ports", "1,2,3", "--kv-capacity-tokens", "3000,4500,9000") == [3000, 4500, 9000]
    assert capacities("--ports", "1,2", "--kv-capacity-tokens", "6000") == [6000, 6000]
    assert capacities("--port", "1") == [400_000]
    with pytest.raises(ValueError, match="2 capacities for 3 ports"):
        capacities("--ports", "1,2,3", "--kv-capacity-tokens", "1,2")
