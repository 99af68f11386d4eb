"""The Responses and Messages APIs and the other engine endpoints, through the gateway with the official SDKs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import anthropic
import httpx2
import openai
import pytest

from gateway.api.prompts import Endpoint
from gateway.app import ENGINE_PATHS
from simulator.fleet import Fleet, running_fleet
from tests.conftest import FAST_GATEWAY, FAST_REPLICA

MODEL = "sim-llama-8b"
INSTRUCTIONS = "You are the release assistant of a compiler team. Answer in one line. " * 30  # ~2,000 chars
BILLING = "x-anthropic-billing-header: cc_version=1.0.83.{}; cc_entrypoint=cli; cch={};"


@dataclass
class ApiFleet:
    replicas: list[str]
    gateway: str              # prefix_aware
    round_robin: str          # a second gateway, --policy round_robin, on the same replicas
    http: httpx2.Client

    def openai(self, gateway: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=(gateway or self.gateway) + "/v1", api_key="unused", max_retries=0,
                             http_client=self.http)

    def anthropic(self, gateway: str | None = None, api_key: str = "unused") -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=gateway or self.gateway, api_key=api_key, max_retries=0,
                                   http_client=self.http)


@pytest.fixture(scope="module")
def apis() -> Iterator[ApiFleet]:
    """Four replicas behind two gateways: prefix_aware and round_robin."""
    with running_fleet() as fleet, httpx2.Client(trust_env=False, timeout=30) as http:
        replicas = fleet.start_replicas(4, args=FAST_REPLICA)
        gateway = fleet.start_gateway(replicas.urls, args=FAST_GATEWAY)
        round_robin = fleet.start_gateway(replicas.urls, args=[*FAST_GATEWAY, "--policy", "round_robin"],
                                          name="gateway-rr")
        yield ApiFleet(replicas.urls, gateway.url, round_robin.url, http)


def prompt_tokens_counted(apis: ApiFleet) -> float:
    metrics = apis.http.get(apis.gateway + "/metrics").text
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("gateway_prompt_tokens_total{"))


# --- OpenAI Responses API ------------------------------------------------------------------------------------


def test_responses_api_through_the_openai_sdk_streaming_and_not(apis: ApiFleet) -> None:
    client = apis.openai()
    first = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input="Release notes?",
                                    max_output_tokens=5)
    assert first.output_text and first.id.startswith("resp_")
    assert first.usage is not None and first.usage.input_tokens > 400
    events = list(client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input="Release notes?",
                                          max_output_tokens=5, stream=True))
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") == 5
    completed = events[-1]
    assert completed.type == "response.completed" and completed.response.usage is not None
    # The same prefix went to the same replica, which had it cached.
    assert completed.response.usage.input_tokens_details.cached_tokens > 400


def test_request_ids_in_the_instructions_do_not_split_a_prefix(apis: ApiFleet) -> None:
    client = apis.openai()
    seen = []
    for request_id in ("req_8f1c2d3e4b", "req_0a1b2c3d4e"):
        raw = client.responses.with_raw_response.create(model=MODEL, input="Status?", max_output_tokens=2,
                                                        instructions=f"Request ID: {request_id}\n{INSTRUCTIONS}")
        seen.append((raw.headers["x-gateway-backend"], raw.headers["x-gateway-rewritten-spans"], raw.parse()))
    assert seen[0][0] == seen[1][0] and seen[0][1] == seen[1][1] == "1"
    usage = seen[1][2].usage
    assert usage is not None and usage.input_tokens_details.cached_tokens > 400


@pytest.mark.parametrize("policy", ["prefix_aware", "round_robin"])
def test_a_conversation_over_previous_response_id_stays_with_the_replica_that_stores_it(
        apis: ApiFleet, policy: str) -> None:
    gateway = apis.gateway if policy == "prefix_aware" else apis.round_robin
    client = apis.openai(gateway)
    raw = client.responses.with_raw_response.create(model=MODEL, instructions=INSTRUCTIONS,
                                                    input=f"Start ({policy}).", max_output_tokens=4)
    owner, response = raw.headers["x-gateway-backend"], raw.parse()
    cached = []
    for turn in range(5):
        raw = client.responses.with_raw_response.create(model=MODEL, instructions=INSTRUCTIONS,
                                                        input=f"Turn {turn}?", previous_response_id=response.id,
                                                        max_output_tokens=4, stream=turn % 2 == 1)
        assert raw.headers["x-gateway-backend"] == owner and raw.headers["x-gateway-route"] == "owner"
        if turn % 2 == 1:
            events = list(raw.parse())
            completed = events[-1]
            assert completed.type == "response.completed"
            response = completed.response
        else:
            response = raw.parse()
        assert response.usage is not None
        cached.append(response.usage.input_tokens_details.cached_tokens)
    assert min(cached) > 400  # each turn continues the previous one's cached history
    # Without the gateway's record, a follow-up sent elsewhere fails: the store is the owner's own.
    elsewhere = next(url for url in apis.replicas if url != owner)
    lost = apis.http.post(elsewhere + "/v1/responses", json={"model": MODEL, "input": "next",
                                                             "previous_response_id": response.id})
    assert lost.status_code == 404 and response.id in lost.json()["error"]["message"]


def test_stored_responses_are_retrieved_deleted_and_cancelled_at_their_owner(apis: ApiFleet) -> None:
    client = apis.openai()
    created = [client.responses.with_raw_response.create(model=MODEL, input=f"topic {i} " * 80, max_output_tokens=2)
               for i in range(6)]
    assert len({raw.headers["x-gateway-backend"] for raw in created}) > 1  # spread: only the record finds each
    ids = [raw.parse().id for raw in created]
    prompt_tokens = prompt_tokens_counted(apis)
    assert [client.responses.retrieve(response_id).id for response_id in ids] == ids
    assert prompt_tokens_counted(apis) == prompt_tokens  # a retrieved response's usage was counted when made
    with pytest.raises(openai.BadRequestError, match="background"):  # the owner's answer: it knows the id
        client.responses.cancel(ids[0])
    client.responses.delete(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])


def test_a_gateway_process_that_did_not_see_a_response_finds_its_replica(apis: ApiFleet) -> None:
    # The second gateway stands for another --workers process, or this one after a restart.
    made = apis.openai().responses.with_raw_response.create(model=MODEL, input="Made through the first.",
                                                            max_output_tokens=2)
    other = apis.openai(apis.round_robin)
    follow_up = other.responses.with_raw_response.create(model=MODEL, input="Continued through the second.",
                                                         previous_response_id=made.parse().id, max_output_tokens=2)
    assert follow_up.headers["x-gateway-route"] == "owner"
    assert follow_up.headers["x-gateway-backend"] == made.headers["x-gateway-backend"]
    assert other.responses.retrieve(follow_up.parse().id).previous_response_id == made.parse().id


def test_a_follow_up_whose_replica_is_gone_gets_a_clear_error(fleet: Fleet) -> None:
    replicas = [fleet.start_replica(args=FAST_REPLICA, name=f"replica-{i}") for i in range(2)]
    gateway = fleet.start_gateway([replica.url for replica in replicas], args=FAST_GATEWAY)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0,
                           http_client=httpx2.Client(trust_env=False, timeout=30))
    raw = client.responses.with_raw_response.create(model=MODEL, input="Remember me.", max_output_tokens=2)
    owner = next(replica for replica in replicas if replica.url == raw.headers["x-gateway-backend"])
    owner.kill()
    deadline = time.monotonic() + 10
    while any(b["healthy"] for b in httpx2.get(gateway.url + "/backends", trust_env=False).json()["backends"]
              if b["url"] == owner.url):
        assert time.monotonic() < deadline, "the gateway never noticed the replica was gone"
        time.sleep(0.1)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=MODEL, input="And now?", previous_response_id=raw.parse().id)
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "stored_response_unavailable"
    assert owner.url in error["message"] and "not available" in error["message"]
    with pytest.raises(openai.NotFoundError, match="not available"):
        client.responses.retrieve(raw.parse().id)
    client.close()


# --- Anthropic Messages API ----------------------------------------------------------------------------------


def test_messages_api_through_the_anthropic_sdk_streaming_and_not(apis: ApiFleet) -> None:
    client = apis.anthropic()
    system = "Messages check. " + INSTRUCTIONS
    first = client.messages.create(model=MODEL, max_tokens=5, system=system,
                                   messages=[{"role": "user", "content": "Hi"}])
    assert first.content[0].type == "text" and first.content[0].text
    assert first.usage.cache_read_input_tokens == 0 and first.usage.input_tokens > 400
    with client.messages.stream(model=MODEL, max_tokens=5, system=system,
                                messages=[{"role": "user", "content": "Hi"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.stop_reason == "max_tokens"
    assert final.usage.cache_read_input_tokens is not None and final.usage.cache_read_input_tokens > 400
    metrics = apis.http.get(apis.gateway + "/metrics").text
    assert 'gateway_requests_total{backend=' in metrics and 'endpoint="messages"' in metrics
    cached = sum(float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("gateway_cached_tokens_total{"))
    assert cached > 400  # read from Anthropic's usage shape


def test_claude_code_billing_headers_do_not_split_a_conversation(apis: ApiFleet) -> None:
    client = apis.anthropic()
    seen = []
    for version, nonce in (("abc", "7f3a9c1e5b2d4f60"), ("abd", "0b1e5c7d9f2a4e68")):
        system = [{"type": "text", "text": BILLING.format(version, nonce)},
                  {"type": "text", "text": "You are a coding agent. " + INSTRUCTIONS}]
        raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=3, system=system,
                                                       messages=[{"role": "user", "content": "Fix the build."}])
        seen.append((raw.headers["x-gateway-backend"], raw.headers["x-gateway-rewritten-spans"], raw.parse()))
    assert seen[0][0] == seen[1][0] and seen[0][1] == seen[1][1] == "1"
    cache_read = seen[1][2].usage.cache_read_input_tokens
    assert cache_read is not None and cache_read > 400


def test_anthropic_token_counting_is_relayed(apis: ApiFleet) -> None:
    counted = apis.anthropic().messages.count_tokens(model=MODEL, system="Count me.",
                                                     messages=[{"role": "user", "content": "hello there"}])
    assert counted.input_tokens > 5


def test_messages_errors_come_in_anthropics_shape(apis: ApiFleet) -> None:
    client = apis.anthropic()
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="claude-9", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert unknown.value.body == {"type": "error", "error": {"type": "not_found_error", "message": (
        "The model 'claude-9' does not exist. Available models: sim-llama-8b.")}}
    empty = apis.http.post(apis.gateway + "/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": []})
    assert empty.status_code == 400 and empty.json()["error"]["type"] == "invalid_request_error"
    assert empty.json()["type"] == "error"


def test_anthropic_clients_authenticate_with_x_api_key(fleet: Fleet, apis: ApiFleet) -> None:
    gateway = fleet.start_gateway(apis.replicas, args=[*FAST_GATEWAY, "--api-key", "sk-team"])
    answer = apis.anthropic(gateway.url, api_key="sk-team").messages.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert answer.content
    with pytest.raises(anthropic.AuthenticationError) as refused:
        apis.anthropic(gateway.url, api_key="sk-wrong").messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert isinstance(refused.value.body, dict) and refused.value.body["error"]["type"] == "authentication_error"


# --- everything else an engine serves ------------------------------------------------------------------------


def test_tokenize_rerank_and_score_are_relayed(apis: ApiFleet) -> None:
    post = apis.http.post
    tokens = post(apis.gateway + "/tokenize", json={"model": MODEL, "prompt": "hello world!"})
    assert tokens.status_code == 200 and tokens.json()["count"] == 3 and "x-gateway-backend" in tokens.headers
    detokenized = post(apis.gateway + "/detokenize", json={"tokens": tokens.json()["tokens"]})
    assert detokenized.status_code == 200 and isinstance(detokenized.json()["prompt"], str)
    for path in ("/v1/rerank", "/rerank"):
        reranked = post(apis.gateway + path, json={"model": MODEL, "query": "fast caches " * 40,
                                                   "documents": ["radix tree", "hash map", "b-tree"], "top_n": 2})
        assert reranked.status_code == 200 and reranked.headers["x-gateway-route"] == "least-load"
        results = reranked.json()["results"]
        assert len(results) == 2 and results[0]["relevance_score"] >= results[1]["relevance_score"]
    scored = post(apis.gateway + "/v1/score", json={"model": MODEL, "text_1": "q", "text_2": ["a", "b"]})
    assert scored.status_code == 200 and len(scored.json()["data"]) == 2


@pytest.mark.parametrize("path", [path for path, endpoint in ENGINE_PATHS.items() if endpoint is not Endpoint.AUDIO])
def test_every_engine_path_reaches_a_replica(apis: ApiFleet, path: str) -> None:
    response = apis.http.post(apis.gateway + path, json={"model": MODEL, "prompt": "x", "messages": []})
    # Whatever the replica makes of it (it serves some of these, 404s the rest), the answer is the replica's.
    assert response.headers["x-gateway-backend"] in apis.replicas and "x-replica-id" in response.headers


def test_an_audio_upload_is_relayed_with_the_model_read_from_its_form(apis: ApiFleet) -> None:
    def upload(model: str) -> httpx2.Response:
        return apis.http.post(apis.gateway + "/v1/audio/transcriptions", data={"model": model},
                              files={"file": ("a.wav", b"RIFF\x00\x01{not json", "audio/wav")})

    unknown = upload("whisper-9")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    relayed = upload(MODEL)  # the simulated replica serves no audio: its own 404 comes back through
    assert relayed.headers["x-gateway-backend"] in apis.replicas and relayed.status_code == 404


@pytest.mark.parametrize("path", ["/flush_cache", "/start_profile", "/stop_profile", "/update_weights_from_disk",
                                  "/abort_request", "/release_memory_occupation", "/control/faults",
                                  "/open_session", "/v1/load_lora_adapter"])
def test_engine_admin_paths_are_not_reachable_through_the_gateway(apis: ApiFleet, path: str) -> None:
    for method in ("GET", "POST"):
        response = apis.http.request(method, apis.gateway + path, json={})
        assert response.status_code == 404 and "error" in response.json()
