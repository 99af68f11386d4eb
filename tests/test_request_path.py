"""Every way a request can end, in-process against fake backends (tests/inprocess.py): what the client sees,
what the backend saw, and that nothing stays held afterwards."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from multidict import CIMultiDictProxy

from gateway.api.headers import parse_networks
from gateway.fleet.backends import Backend
from gateway.fleet.upstream import Failure, UpstreamFailure, UpstreamResponse, write_unless_closed
from tests.inprocess import (
    Behaviour,
    FakeBackend,
    Harness,
    answer_status,
    answer_stream,
    chunk,
    close_before_answer,
    running_gateway,
    silent,
    stream_forever,
    stream_then_cut,
)


def sse_events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


async def test_non_streamed_answer_is_relayed_with_gateway_headers() -> None:
    async with running_gateway(FakeBackend()) as harness:
        status, body, headers = await harness.chat()
        assert status == 200 and body["choices"][0]["message"]["content"] == "ok"
        assert headers["x-gateway-backend"] == "backend-1"  # the name; the URL stays internal
        assert harness.metric("gateway_prompt_tokens_total") == 3
        harness.assert_nothing_held()


async def test_backend_url_is_exposed_only_when_asked_for() -> None:
    backend = FakeBackend()
    async with running_gateway(backend, expose_backend_urls=True) as harness:
        _, _, headers = await harness.chat()
        assert headers["x-gateway-backend"] == backend.url


async def test_streamed_answer_arrives_chunk_by_chunk() -> None:
    async with running_gateway(FakeBackend(default=answer_stream)) as harness:
        status, body, headers = await harness.chat(stream=True)
        assert status == 200 and headers["content-type"] == "text/event-stream"
        events = sse_events(body["raw"])
        assert events[-1] == "[DONE]" and len(events) == 4
        harness.assert_nothing_held()


async def test_refused_connection_is_retried_on_another_backend() -> None:
    live = FakeBackend()
    async with running_gateway(live, dead=1) as harness:
        statuses = [(await harness.chat(f"question {index}"))[0] for index in range(4)]
        assert statuses == [200] * 4
        dead: Backend = harness.gateway.pool.backends[1]
        assert dead.outlier.ejected and len(live.received) == 4
        harness.assert_nothing_held()


async def test_gateway_out_of_descriptors_is_503_and_never_the_backend_fault() -> None:
    async with running_gateway(FakeBackend()) as harness:
        async def out_of_files(*args: object, **kwargs: object) -> UpstreamResponse:
            raise UpstreamFailure(Failure.LOCAL, "OSError: [Errno 24] Too many open files")

        harness.gateway.client.open = out_of_files  # type: ignore[method-assign]
        status, body, headers = await harness.chat()
        assert status == 503 and headers["Retry-After"] == "1"
        assert body["error"]["code"] == "gateway_overloaded"
        assert harness.gateway.pool.backends[0].healthy
        assert harness.metric("gateway_requests_total", status="503") == 1  # as the client saw it
        assert harness.metric("gateway_requests_total", status="502") == 0
        harness.assert_nothing_held()


async def test_health_check_the_gateway_could_not_open_is_no_verdict_on_the_backend() -> None:
    async with running_gateway(FakeBackend()) as harness:
        session = harness.gateway.client.session

        def out_of_files(*args: object, **kwargs: object) -> object:
            raise OSError(errno.EMFILE, "Too many open files")

        session.get = out_of_files  # type: ignore[method-assign]
        for _ in range(harness.gateway.config.health.failure_threshold + 2):
            await harness.gateway.upkeep.check_all()
        assert harness.gateway.pool.backends[0].healthy


async def test_connection_closed_before_the_answer_is_retried() -> None:
    backend = FakeBackend(script=[close_before_answer])
    async with running_gateway(backend) as harness:
        status, _, _ = await harness.chat()
        assert status == 200 and len(backend.received) == 2
        assert harness.metric("gateway_upstream_errors_total", kind="broken_before_answer") == 1
        assert harness.metric("gateway_requests_total") == 1  # the client saw one request
        harness.assert_nothing_held()


async def test_requests_routed_in_one_turn_reach_the_backend_whole_and_in_their_own_exchanges() -> None:
    # The gateway writes each request at the end of the event loop's turn, those of one turn back to back.
    backend = FakeBackend()
    async with running_gateway(backend) as harness:
        contents = [f"question {index} " + "x" * index * 500 for index in range(20)]
        answers = await asyncio.gather(*(harness.chat(content) for content in contents))
        assert [status for status, _, _ in answers] == [200] * 20
        assert sorted(json.loads(body)["messages"][0]["content"] for body in backend.bodies) == sorted(contents)
        harness.assert_nothing_held()


def test_request_whose_connection_closed_before_its_write_is_not_written() -> None:
    class ClosedConnection(asyncio.Transport):  # as a failed or cancelled exchange leaves it
        def is_closing(self) -> bool:
            return True

        def writelines(self, list_of_data: Any) -> None:
            raise AssertionError("written to a closed connection (uvloop raises here)")

    write_unless_closed(ClosedConnection(), (b"POST /v1/chat/completions HTTP/1.1\r\n\r\n",))


async def test_backend_that_always_closes_early_is_502_after_the_retries() -> None:
    backend = FakeBackend(default=close_before_answer)
    async with running_gateway(backend, max_retries=2) as harness:
        status, body, _ = await harness.chat()
        assert status == 502 and body["error"]["code"] == "upstream_broken"
        assert len(backend.received) == 3
        harness.assert_nothing_held()


async def test_stream_broken_mid_way_ends_with_an_sse_error_event() -> None:
    async with running_gateway(FakeBackend(default=stream_then_cut(2))) as harness:
        status, body, _ = await harness.chat(stream=True)
        assert status == 200
        events = sse_events(body["raw"])
        assert len(events) == 3 and "[DONE]" not in events
        assert json.loads(events[-1])["error"]["code"] == "upstream_broken"
        assert harness.metric("gateway_requests_total", status="200") == 1
        assert harness.metric("gateway_upstream_errors_total", kind="broken") == 1
        harness.assert_nothing_held()


async def test_silent_backend_is_504_after_the_first_byte_timeout() -> None:
    backend = FakeBackend(default=silent(5.0))
    async with running_gateway(backend, first_byte_timeout_s=0.2) as harness:
        status, body, _ = await harness.chat(stream=True)
        assert status == 504 and body["error"]["type"] == "timeout"
        assert len(backend.received) == 1  # a timeout is not retried: the engine may be generating
        await asyncio.sleep(0.05)
        assert backend.abandoned == 1  # and the backend's request was closed
        harness.assert_nothing_held()


async def test_non_streamed_answer_is_504_after_the_request_timeout() -> None:
    backend = FakeBackend(default=silent(5.0))
    async with running_gateway(backend, request_timeout_s=0.2, first_byte_timeout_s=60.0) as harness:
        status, body, _ = await harness.chat()
        assert status == 504 and body["error"]["code"] == "upstream_timeout"
        harness.assert_nothing_held()


def stream_pausing_after(chunks: int, pause_s: float) -> Behaviour:
    """Headers and the first chunks at once (as engines send them), a pause, then the rest."""
    async def behaviour(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for index in range(chunks):
            await response.write(chunk(f"part {index}"))
        await asyncio.sleep(pause_s)
        await response.write(chunk("after the pause"))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    return behaviour


async def test_pause_after_the_first_chunks_is_judged_by_the_idle_timeout_not_the_first_byte_one() -> None:
    backend = FakeBackend(default=stream_pausing_after(2, pause_s=0.6))
    async with running_gateway(backend, first_byte_timeout_s=0.2, request_timeout_s=5.0) as harness:
        status, body, _ = await harness.chat(stream=True)
        assert status == 200 and sse_events(body["raw"])[-1] == "[DONE]"
        assert not harness.gateway.pool.backends[0].outlier.ejected
        harness.assert_nothing_held()


async def test_client_that_leaves_closes_the_backend_request_and_releases_its_placement() -> None:
    backend = FakeBackend(default=stream_forever())
    async with running_gateway(backend) as harness:
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        response = await harness.client.post("/v1/chat/completions", json=body)
        assert response.status == 200
        await response.content.readany()
        assert harness.gateway.pool.backends[0].in_flight == 1
        response.close()  # the client leaves mid-stream
        for _ in range(100):
            if backend.abandoned and harness.gateway.pool.backends[0].in_flight == 0:
                break
            await asyncio.sleep(0.01)
        assert backend.abandoned == 1
        assert harness.metric("gateway_requests_total", status="499") == 1
        harness.assert_nothing_held()


@pytest.mark.parametrize("status,code", [(400, "context_length_exceeded"), (404, "not_found"),
                                         (500, "internal"), (503, "busy")])
async def test_backend_error_answers_are_relayed_unchanged(status: int, code: str) -> None:
    async with running_gateway(FakeBackend(default=answer_status(status, code))) as harness:
        got, body, headers = await harness.chat()
        assert got == status and body["error"]["code"] == code
        assert headers["x-backend-marker"] == "kept"
        backend = harness.gateway.pool.backends[0]
        assert backend.healthy  # an answer, even 5xx, is not a broken exchange
        harness.assert_nothing_held()


async def test_overload_beyond_the_queue_wait_is_429_with_retry_after() -> None:
    async with running_gateway(FakeBackend(default=silent(0.5)), max_concurrent_requests=1,
                               max_queue_wait_s=0.1) as harness:
        first = asyncio.ensure_future(harness.chat("slow"))
        await asyncio.sleep(0.05)
        status, body, headers = await harness.chat("shed")
        assert status == 429 and headers["Retry-After"] == "1"
        assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "too_many_requests"
        async with harness.client.get("/health") as health:  # probes never wait for a slot
            assert health.status == 200
        async with harness.client.get("/ready") as ready:
            assert (await ready.json())["requests"] == {"in_flight": 1, "waiting": 0}
        assert (await first)[0] == 200
        assert harness.metric("gateway_requests_total", status="429") == 1
        harness.assert_nothing_held()


async def test_waiting_request_gets_the_slot_of_one_that_finished() -> None:
    async with running_gateway(FakeBackend(default=silent(0.1)), max_concurrent_requests=1,
                               max_queue_wait_s=2.0) as harness:
        results = await asyncio.gather(*(harness.chat(f"q{index}") for index in range(3)))
        assert [status for status, _, _ in results] == [200, 200, 200]
        harness.assert_nothing_held()


async def test_client_that_leaves_while_queued_gives_its_place_back() -> None:
    async with running_gateway(FakeBackend(default=silent(0.3)), max_concurrent_requests=1,
                               max_queue_wait_s=5.0) as harness:
        first = asyncio.ensure_future(harness.chat("running"))
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(harness.chat("queued"))
        await asyncio.sleep(0.05)
        assert harness.gateway.admission.waiting == 1
        queued.cancel()
        await asyncio.sleep(0.05)
        assert harness.gateway.admission.waiting == 0
        assert (await first)[0] == 200
        harness.assert_nothing_held()


async def test_api_key_is_required_everywhere_but_the_probes() -> None:
    async with running_gateway(FakeBackend(), api_keys=("client-key",), admin_api_keys=("admin-key",)) as harness:
        status, body, headers = await harness.chat()
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
        assert body["error"] == {"message": body["error"]["message"], "type": "invalid_request_error",
                                 "param": None, "code": "invalid_api_key"}
        assert (await harness.chat(headers={"Authorization": "Bearer wrong"}))[0] == 401
        assert (await harness.chat(headers={"Authorization": "Bearer client-key"}))[0] == 200
        for path in ("/health", "/ready"):
            async with harness.client.get(path) as response:
                assert response.status == 200
        for key, expected in ((None, 401), ("client-key", 401), ("admin-key", 200)):
            auth = {"Authorization": f"Bearer {key}"} if key else {}
            async with harness.client.get("/metrics", headers=auth) as response:
                assert response.status == expected
        assert harness.metric("gateway_requests_total", status="401") == 2


async def test_body_over_the_limit_is_413() -> None:
    backend = FakeBackend()
    async with running_gateway(backend, max_body_bytes=1024) as harness:
        status, body, _ = await harness.chat("x" * 2000)
        assert status == 413 and body["error"]["type"] == "invalid_request_error"
        chunked = harness.client.post("/v1/chat/completions", data=_chunks(b"x" * 4096))  # no Content-Length
        async with chunked as response:
            assert response.status == 413
        assert not backend.received
        assert harness.metric("gateway_requests_total", status="413") == 2


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(data), 512):
        yield data[start:start + 512]


@pytest.mark.parametrize("raw,why", [
    (b"{", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"messages": "hi"}', "wrong type"),
    (b'{"messages": []}', "at least one message"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "model": 7}', "'model' must be a string"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "model": "\\ud800"}', "does not exist"),
])
async def test_bad_bodies_are_400_or_404_in_openai_shape(raw: bytes, why: str) -> None:
    backend = FakeBackend()
    async with running_gateway(backend) as harness:
        async with harness.client.post("/v1/chat/completions", data=raw,
                                       headers={"content-type": "application/json"}) as response:
            body = await response.json()
            assert response.status in (400, 404) and why in body["error"]["message"], body
        assert not backend.received
        assert harness.metric("gateway_requests_total", status=str(response.status)) == 1


async def test_deeply_nested_prompt_that_parses_is_400_or_relayed_never_500() -> None:
    nested = "[" * 900 + "]" * 900
    raw = ('{"messages": [{"role": "user", "content": ' + nested + '}]}').encode()
    async with running_gateway(FakeBackend()) as harness:
        async with harness.client.post("/v1/chat/completions", data=raw) as response:
            assert response.status in (200, 400)
        harness.assert_nothing_held()


async def test_lone_surrogate_in_a_rewritten_prompt_is_forwarded_as_the_client_escaped_it() -> None:
    backend = FakeBackend()
    raw = (b'{"messages": [{"role": "system", "content": "request id 3f2a9c1e-8b7d-4e6f-9a0b-1c2d3e4f5a6b '
           b'\\ud800 you are helpful"}, {"role": "user", "content": "hi"}]}')
    async with running_gateway(backend) as harness:
        async with harness.client.post("/v1/chat/completions", data=raw) as response:
            assert response.status == 200
        assert b"\\ud800" in backend.bodies[0]


async def test_credentials_stay_at_the_gateway_and_the_backend_key_is_sent_instead() -> None:
    backend = FakeBackend()
    async with running_gateway(backend) as harness:
        await harness.chat(headers={"Authorization": "Bearer client-secret", "Cookie": "session=1",
                                    "Connection": "keep-alive, x-hop", "x-hop": "1", "x-kept": "yes",
                                    "x-request-id": "r" * 500})
        received = backend.received[0].headers
        assert "Authorization" not in received and "Cookie" not in received and "x-hop" not in received
        assert received["x-kept"] == "yes" and received["X-Forwarded-For"] == "127.0.0.1"
        assert len(received["x-request-id"]) <= 128


async def test_header_that_cannot_be_forwarded_is_400_and_holds_no_backend() -> None:
    backend = FakeBackend()
    async with running_gateway(backend) as harness:
        server = harness.client.server
        reader, writer = await asyncio.open_connection(server.host, server.port)
        body = json.dumps({"messages": [{"role": "user", "content": "hello"}]}).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                     b"x-note: caf\xe9\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        status_line = await reader.readline()
        writer.close()
        assert b" 400 " in status_line and not backend.received
        assert harness.metric("gateway_requests_total", status="400") == 1
        harness.assert_nothing_held()


async def test_forwarded_for_is_extended_only_behind_a_trusted_proxy() -> None:
    spoofed = {"X-Forwarded-For": "6.6.6.6", "Forwarded": "for=6.6.6.6"}
    for trusted, chain in (((), "127.0.0.1"), (parse_networks(["127.0.0.0/8"]), "6.6.6.6, 127.0.0.1")):
        backend = FakeBackend()
        async with running_gateway(backend, trusted_proxies=trusted) as harness:
            await harness.chat(headers=spoofed)
            assert backend.received[0].headers["X-Forwarded-For"] == chain


async def test_unknown_route_and_method_are_refused_in_openai_shape() -> None:
    async with running_gateway(FakeBackend()) as harness:
        for method, path, status in (("GET", "/v1/nope", 404), ("GET", "/v1/chat/completions", 405)):
            async with harness.client.request(method, path) as response:
                body = await response.json()
                assert response.status == status and body["error"]["type"] == "invalid_request_error"


async def test_rejected_request_gets_an_access_log_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    async with running_gateway(FakeBackend()) as harness, harness.client.post("/v1/chat/completions", data=b"{",
                                   headers={"x-request-id": "bad-json-1"}) as response:
        assert response.status == 400
    [line] = [record.getMessage() for record in caplog.records if record.name == "gateway.access"]
    assert "status=400" in line and "id=bad-json-1" in line


async def test_backend_gets_exactly_the_encoding_headers_the_client_sent() -> None:
    backend = FakeBackend()
    body = {"messages": [{"role": "user", "content": "hi"}]}
    async with running_gateway(backend) as harness:
        bare = ("Accept-Encoding", "User-Agent", "Accept")
        async with harness.client.post("/v1/chat/completions", json=body, skip_auto_headers=bare) as response:
            assert response.status == 200
        async with harness.client.post("/v1/chat/completions", json=body,
                                       headers={"Accept-Encoding": "identity"}) as response:
            assert response.status == 200
    first, second = (request.headers for request in backend.received)
    assert "Accept-Encoding" not in first and "User-Agent" not in first
    assert second["Accept-Encoding"] == "identity"


async def test_query_string_reaches_the_backend() -> None:
    backend = FakeBackend()
    async with running_gateway(backend) as harness:
        async with harness.client.post("/v1/chat/completions?api-version=2", json={"messages": [{"role": "user",
                                                                                  "content": "hi"}]}) as response:
            assert response.status == 200
        assert backend.received[0].path_qs == "/v1/chat/completions?api-version=2"


async def test_shutdown_makes_ready_503_lets_short_answers_finish_and_ends_the_rest_with_an_error_event(
        caplog: pytest.LogCaptureFixture) -> None:
    slow, endless = FakeBackend(default=silent(0.2)), FakeBackend(default=stream_forever())
    async with running_gateway(slow, endless, shutdown_grace_s=0.5) as harness:
        short = await _placed_on(harness, 0)
        long_stream = await _placed_on(harness, 1, stream=True)
        await asyncio.sleep(0.05)
        caplog.set_level(logging.INFO)
        stopping = asyncio.ensure_future(harness.gateway.on_shutdown(harness.client.app))
        await asyncio.sleep(0.01)
        async with harness.client.get("/ready") as ready:
            assert ready.status == 503 and (await ready.json())["stopping"] is True
        await stopping
        status, body, _ = await short
        assert status == 200 and body["choices"]
        status, body, _ = await long_stream
        events = sse_events(body["raw"])
        assert status == 200 and json.loads(events[-1])["error"]["code"] == "shutting_down"
        assert harness.metric("gateway_requests_total", status="200") == 2
        assert "Traceback" not in caplog.text and "CancelledError" not in caplog.text
        harness.assert_nothing_held()


async def _placed_on(harness: Harness, backend_index: int, **extra: Any
                     ) -> asyncio.Future[tuple[int, dict[str, Any], CIMultiDictProxy[str]]]:
    """A chat request under way on one backend: the others are marked down until it is placed."""
    backends = harness.gateway.pool.backends
    for index, backend in enumerate(backends):
        backend.healthy = index == backend_index
    request = asyncio.ensure_future(harness.chat(f"to {backend_index}", **extra))
    while backends[backend_index].in_flight == 0:
        await asyncio.sleep(0.005)
    for backend in backends:
        backend.healthy = True
    return request


async def test_shutdown_answers_503_to_requests_still_waiting_for_the_backend_when_the_grace_ends(
        caplog: pytest.LogCaptureFixture) -> None:
    async with running_gateway(FakeBackend(default=silent(5.0)), shutdown_grace_s=0.3) as harness:
        waiting = asyncio.ensure_future(harness.chat(stream=True))
        await asyncio.sleep(0.1)
        caplog.set_level(logging.INFO)
        await harness.gateway.on_shutdown(harness.client.app)
        status, body, headers = await waiting
        assert status == 503 and body["error"]["code"] == "shutting_down" and headers["Retry-After"] == "1"
        assert harness.metric("gateway_requests_total", status="503") == 1
        assert "status=503 error=shutdown" in caplog.text
        assert "Traceback" not in caplog.text
        harness.assert_nothing_held()


async def test_client_that_stops_reading_is_dropped_after_the_write_timeout() -> None:
    backend = FakeBackend(default=stream_forever(period_s=0.0, payload_bytes=60_000))
    async with running_gateway(backend, write_timeout_s=0.3) as harness:
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        response = await harness.client.post("/v1/chat/completions", json=body)
        assert response.status == 200
        assert response.connection is not None
        response.connection.transport.pause_reading()  # type: ignore[union-attr]
        for _ in range(300):
            if backend.abandoned:
                break
            await asyncio.sleep(0.02)
        assert backend.abandoned == 1
        response.close()
        await asyncio.sleep(0.02)
        assert harness.metric("gateway_requests_total", status="499") == 1
        harness.assert_nothing_held()


def post_from_a_thread(harness: Harness, body: bytes, receive_buffer_bytes: int | None = None,
                       read: bool = True) -> tuple[float, socket.socket]:
    """Send a chat request over a blocking socket, outside the event loop; when the answer's first bytes arrived
    (or when sent, with `read=False`), and the open socket."""
    url = harness.client.make_url("/")
    sock = socket.socket()
    if receive_buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
    sock.connect((url.host, url.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    if read:
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    return time.monotonic(), sock


async def test_a_small_answer_leaves_before_the_record_step_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    async with running_gateway(FakeBackend()) as harness:
        record, recorded_at = harness.gateway.record, []

        def slow_record(*args: Any) -> None:
            recorded_at.append(time.monotonic())
            time.sleep(0.5)  # the event loop stands still: only what was written already reaches the client
            record(*args)

        monkeypatch.setattr(harness.gateway, "record", slow_record)
        body = json.dumps({"messages": [{"role": "user", "content": "hello"}]}).encode()
        answered_at, sock = await asyncio.to_thread(post_from_a_thread, harness, body)
        sock.close()
        assert answered_at - recorded_at[0] < 0.4
        harness.assert_nothing_held()


async def test_a_large_answer_does_not_hold_its_backend_while_the_client_reads_slowly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def answer_large(request: web.Request) -> web.StreamResponse:
        return web.json_response({"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "x" * 1_000_000}, "finish_reason": "stop"}]})

    async with running_gateway(FakeBackend(default=answer_large)) as harness:
        relay_answer = harness.gateway.relay_answer

        async def with_small_send_buffer(request: web.Request, *args: Any) -> web.StreamResponse:
            assert request.transport is not None  # so that the kernel cannot take the whole answer off our hands
            request.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            return await relay_answer(request, *args)

        monkeypatch.setattr(harness.gateway, "relay_answer", with_small_send_buffer)
        body = json.dumps({"messages": [{"role": "user", "content": "hello"}]}).encode()
        _, sock = await asyncio.to_thread(post_from_a_thread, harness, body, 4096, False)
        with sock:
            for _ in range(100):  # the answer stays unread on its way
                if harness.gateway.pool.backends[0].in_flight == 0 and harness.backends[0].received:
                    break
                await asyncio.sleep(0.02)
            harness.assert_nothing_held()


async def test_client_that_expects_100_continue_is_told_to_send_its_body() -> None:
    # curl asks so for every body over 1 KiB; the relayed paths skip the router, which answers it.
    async with running_gateway(FakeBackend()) as harness:
        body = json.dumps({"messages": [{"role": "user", "content": "x" * 2000}]}).encode()
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))

        def exchange() -> bytes:
            url = harness.client.make_url("/")
            with socket.create_connection((url.host, url.port), timeout=5) as sock:
                sock.sendall(head)
                assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue")
                sock.sendall(body)
                return sock.recv(65536)

        assert (await asyncio.to_thread(exchange)).startswith(b"HTTP/1.1 200")
        assert harness.backends[0].bodies == [body]
        # The gateway has the body: the backend is not asked to wait for a go-ahead of its own.
        assert "Expect" not in harness.backends[0].received[0].headers


async def test_backend_that_does_not_accept_in_time_is_a_connect_failure_not_a_timeout() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        fillers = [socket.socket() for _ in range(3)]  # a full accept queue: the kernel drops further attempts
        for filler in fillers:
            filler.setblocking(False)
            filler.connect_ex(listener.getsockname())
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        try:
            async with running_gateway(silent_urls=[url], connect_timeout_s=0.2, max_retries=0) as harness:
                status, body, _ = await harness.chat()
                assert status == 502 and body["error"]["code"] == "upstream_broken"
                assert harness.metric("gateway_upstream_errors_total", kind="connect") == 1
                harness.assert_nothing_held()
        finally:
            for filler in fillers:
                filler.close()
