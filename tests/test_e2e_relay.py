"""The relay is transparent: what the client sends reaches the backend unchanged, and back."""

from __future__ import annotations

import json
import os

import httpx2

from simulator.fleet import Fleet
from tests.capture_backend import capture_backend


def test_body_reaches_the_backend_byte_for_byte_and_headers_are_cleaned(fleet: Fleet) -> None:
    with capture_backend() as (url, captured):
        gateway = fleet.start_gateway([url], args=["--log-level", "warning"])
        body = (b'{"model": "capture-model", "messages": [{"role": "user", "content": "caf\\u00e9 \xe2\x98\x95"}],'
                b' "stream_options": {"include_usage": true}, "no_stop_trim": true, "my_unknown_field": [1, {"a": 2}]}')
        response = httpx2.post(gateway.url + "/v1/chat/completions?api-version=2", content=body, trust_env=False,
                              headers={"content-type": "application/json", "authorization": "Bearer k",
                                       "cookie": "session=1", "x-api-key": "k", "x-request-id": "rid-1",
                                       "connection": "keep-alive, x-hop", "x-hop": "1", "te": "trailers",
                                       "accept-encoding": "identity", "x-forwarded-for": "6.6.6.6"})
    assert response.status_code == 200
    assert captured.bodies == [body]
    forwarded = captured.headers[0]
    assert forwarded["x-request-id"] == "rid-1"
    # Credentials are for the gateway; hop-by-hop headers and those Connection names stop here.
    assert not {"authorization", "cookie", "x-api-key", "te", "x-hop"} & set(forwarded)
    # Exactly the encoding the client asked for; the client's address, not what an untrusted client claimed.
    assert forwarded["accept-encoding"] == "identity"
    assert forwarded["x-forwarded-for"] == "127.0.0.1" and forwarded["forwarded"] == "for=127.0.0.1"
    assert response.headers["x-upstream-marker"] == "kept"
    assert response.headers["x-gateway-backend"] == url


def test_backend_errors_are_relayed_unchanged(fleet: Fleet) -> None:
    with capture_backend() as (url, _):
        gateway = fleet.start_gateway([url], args=["--log-level", "warning"])
        response = httpx2.post(gateway.url + "/v1/chat/completions", trust_env=False,
                              json={"messages": [{"role": "user", "content": "x"}], "reject": True})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_upstream_calls_ignore_proxy_variables_pointing_at_a_dead_proxy(fleet: Fleet) -> None:
    dead_proxy = "http://127.0.0.1:9"  # discard port: nothing listens there
    env = {name: dead_proxy for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                                         "all_proxy")}
    env["NO_PROXY"] = env["no_proxy"] = ""
    replicas = fleet.start_replicas(2, args=["--time-scale", "0.01", "--log-level", "warning"])
    gateway = fleet.start_gateway(replicas.urls, env={**os.environ, **env})  # waits for /ready: health checks passed
    for stream in (False, True):
        response = httpx2.post(gateway.url + "/v1/chat/completions", trust_env=False, timeout=30,
                              json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2,
                                    "stream": stream})
        assert response.status_code == 200
    assert "are set and ignored" in gateway.log_tail(20000)
    assert json.loads(httpx2.get(gateway.url + "/v1/models", trust_env=False).text)["data"]
