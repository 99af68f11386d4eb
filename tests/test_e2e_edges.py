"""The gateway's edges with real processes on loopback: its own resource limits, overload, hostile and slow
clients, shutdown, API keys and what reaches a backend. Each test is a row of the README's table of faults
("What the gateway withstands"); flags make every timeout small so each test takes seconds."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import resource
import select
import signal
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import httpx2
import pytest

from simulator.fleet import Fleet, Process, redis_installed
from tests.capture_backend import capture_backend
from tests.conftest import FAST_GATEWAY, FAST_REPLICA

CHAT = "/v1/chat/completions"


def question(content: str = "hello", **extra: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 3, **extra}


def backends_of(gateway: str) -> list[dict[str, object]]:
    answer: list[dict[str, object]] = httpx2.get(gateway + "/backends", trust_env=False).json()["backends"]
    return answer


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` at `url`/metrics that carry `labels`."""
    total = 0.0
    for line in httpx2.get(url + "/metrics", trust_env=False).text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and \
                all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def rss_kib(process: Process) -> int:
    with open(f"/proc/{process.popen.pid}/status", encoding="ascii") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def open_files_limit(count: int) -> Callable[[], None]:
    """For preexec_fn: the child may open `count` files, soft and hard, so it cannot raise its own limit."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (count, count))
    return limit


async def many_clients(url: str, count: int, body: dict[str, object], timeout_s: float) -> Counter[str]:
    """`count` clients at once, each on its own connection: how many got which status, or "closed" (no answer),
    or another exception's name."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async def one() -> str:
            try:
                async with session.post(url + CHAT, json=body) as response:
                    await response.read()
                    return str(response.status)
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                return "closed"  # the connection closed before an answer
            except (aiohttp.ClientError, TimeoutError) as exc:
                return type(exc).__name__
        return Counter(await asyncio.gather(*(one() for _ in range(count))))


def test_gateway_out_of_file_descriptors_sheds_load_and_marks_no_backend_down(fleet: Fleet) -> None:
    replicas = fleet.start_replicas(3, args=[*FAST_REPLICA, "--latency-ms", "300"])
    # The connection cap (sized from the limit) would close the extra clients before descriptors run out.
    gateway = fleet.start_gateway(replicas.urls, args=[*FAST_GATEWAY, "--max-connections", "100000"],
                                  preexec_fn=open_files_limit(256))
    outcomes = asyncio.run(many_clients(gateway.url, 1000, question(), timeout_s=60))
    # Answered, told to retry (503 + Retry-After: the gateway could not open a connection upstream), or closed
    # unanswered (a connection the process had no descriptor for: libuv accepts and closes it). Never a 502.
    assert outcomes["200"] > 0 and outcomes["503"] > 0, outcomes
    assert set(outcomes) <= {"200", "503", "closed"}, outcomes
    assert all(backend["healthy"] and not backend["ejected"] for backend in backends_of(gateway.url))
    assert metric(gateway.url, "gateway_upstream_errors_total", kind="local") == outcomes["503"]
    assert metric(gateway.url, "gateway_upstream_errors_total", kind="connect") == 0
    assert metric(gateway.url, "gateway_requests_total", status="502") == 0
    assert httpx2.post(gateway.url + CHAT, json=question(), trust_env=False, timeout=30).status_code == 200


def test_overload_is_shed_with_429_while_probes_answer_at_once(fleet: Fleet) -> None:
    replica = fleet.start_replica(args=[*FAST_REPLICA, "--latency-ms", "1500"])
    gateway = fleet.start_gateway(replica.urls, args=[*FAST_GATEWAY, "--max-concurrent-requests", "4",
                                                      "--max-queue-wait-secs", "0.3"])

    async def overload() -> tuple[Counter[str], list[float]]:
        load = asyncio.ensure_future(many_clients(gateway.url, 40, question(), timeout_s=30))
        await asyncio.sleep(0.5)
        probe_s = []
        async with aiohttp.ClientSession() as session:
            for path in ("/health", "/ready", "/metrics"):
                started = time.monotonic()
                async with session.get(gateway.url + path) as response:
                    assert response.status == 200
                probe_s.append(time.monotonic() - started)
            async with session.post(gateway.url + CHAT, json=question()) as shed:
                assert shed.status == 429 and shed.headers["Retry-After"] == "1"
                error = (await shed.json())["error"]
                assert error["type"] == "rate_limit_error" and error["code"] == "too_many_requests"
        return await load, probe_s

    outcomes, probe_s = asyncio.run(overload())
    # 4 at a time, each 1.5 s: the rest wait 0.3 s for a slot and are shed (a late arrival may get one)
    assert set(outcomes) == {"200", "429"} and outcomes["200"] >= 4 and outcomes["429"] >= 30, outcomes
    assert max(probe_s) < 0.5, probe_s
    again = httpx2.post(gateway.url + CHAT, json=question(), trust_env=False, timeout=30)  # served again now
    assert again.status_code == 200
    assert metric(gateway.url, "gateway_requests_total", status="429") == outcomes["429"] + 1


async def slowloris(url: str, connections: int, seconds: float) -> list[float]:
    """`connections` clients that send a request's headers one byte a second; when each was closed, in
    seconds from the start (inf when still open after `seconds`)."""
    host, port = url.removeprefix("http://").split(":")
    started = time.monotonic()
    head = f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nX-Slow: ".encode()

    async def one() -> float:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(head)
            while time.monotonic() - started < seconds:
                writer.write(b"a")
                try:
                    if await asyncio.wait_for(reader.read(1024), timeout=1.0) == b"":
                        return time.monotonic() - started
                except TimeoutError:
                    continue
                return time.monotonic() - started  # answered (400?) counts as let go
            return float("inf")
        except ConnectionError:
            return time.monotonic() - started
        finally:
            writer.close()

    return await asyncio.gather(*(one() for _ in range(connections)))


def test_slowloris_connections_are_closed_after_the_keepalive_timeout_and_others_are_served(fleet: Fleet) -> None:
    replica = fleet.start_replica(args=FAST_REPLICA)
    gateway = fleet.start_gateway(replica.urls, args=[*FAST_GATEWAY, "--keepalive-timeout-secs", "2"])

    async def attack() -> tuple[list[float], list[int]]:
        slow = asyncio.ensure_future(slowloris(gateway.url, 100, seconds=8))
        statuses = []
        async with aiohttp.ClientSession() as session:
            for index in range(20):
                async with session.post(gateway.url + CHAT, json=question(f"well-behaved {index}")) as response:
                    statuses.append(response.status)
                await asyncio.sleep(0.1)
        return await slow, statuses

    closed_after_s, statuses = asyncio.run(attack())
    assert statuses == [200] * 20
    assert max(closed_after_s) < 5, sorted(closed_after_s)[-5:]


def send_raw(url: str, head: bytes, chunks: int, chunk: bytes) -> bytes:
    """Send `head`, then up to `chunks` copies of `chunk` while the gateway reads; what it answered."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            sock.sendall(head)
            for _ in range(chunks):
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            return sock.recv(4096)
        except ConnectionResetError:
            return b""


def refused(answer: bytes) -> bool:
    """aiohttp's own 400 (plain text: its parser refuses before the app sees a request)."""
    return answer.startswith(b"HTTP/1.") and answer.split(b" ", 2)[1] in (b"400", b"431")


def test_huge_and_too_many_headers_are_refused_and_memory_stays_bounded(fleet: Fleet) -> None:
    replica = fleet.start_replica(args=FAST_REPLICA)
    gateway = fleet.start_gateway(replica.urls, args=FAST_GATEWAY)
    before_kib = rss_kib(gateway)
    start = f"POST {CHAT} HTTP/1.1\r\nHost: gateway\r\n".encode()
    for _ in range(3):  # rounds of ten concurrent unfinished 20 MB headers
        with ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(lambda _: send_raw(gateway.url, start + b"X-Huge: ", 20 * 1024, b"a" * 1024),
                                    range(10)))
        assert all(answer == b"" or refused(answer) for answer in answers), [a[:100] for a in answers]
    many = b"".join(b"X-Many-%d: 1\r\n" % index for index in range(200))
    answer = send_raw(gateway.url, start + many + b"Content-Length: 2\r\n\r\n{}", 0, b"")
    assert refused(answer), answer[:200]
    assert rss_kib(gateway) - before_kib < 40 * 1024  # 30 x 20 MB sent; was 300+ MB before bound_request_queue
    assert httpx2.post(gateway.url + CHAT, json=question(), trust_env=False, timeout=30).status_code == 200


def peak_rss_growth_kib(process: Process, action: Callable[[], object]) -> int:
    """How far the process's resident memory rose above where it was while `action` ran."""
    with open(f"/proc/{process.popen.pid}/clear_refs", "w", encoding="ascii") as clear:
        clear.write("5")  # the high-water mark restarts from the current RSS
    before_kib = rss_kib(process)
    action()
    with open(f"/proc/{process.popen.pid}/status", encoding="ascii") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) - before_kib


def test_a_30_mb_prompt_costs_a_bounded_multiple_of_its_size_in_flight(fleet: Fleet) -> None:
    # A small index keeps what the prompt's blocks add to it (~200 B a block, up to a quarter of the index) out
    # of the measure: that stays after the request, bounded by --max-tree-size.
    with capture_backend() as (url, captured):
        gateway = fleet.start_gateway([url], args=[*FAST_GATEWAY, "--max-tree-size", "64000"])
        text = "".join(f"line {i} of a very long document\n" for i in range(1_000_000))[:30_000_000]
        for prefix, bound in (("", 6), ("request 3f2b8c1e-9d4a-4e7b-8c2d-1a2b3c4d5e6f: ", 7)):  # the rewriter's too
            body = json.dumps({"model": "capture-model", "messages": [{"role": "user", "content": prefix + text}]})
            grown_kib = peak_rss_growth_kib(gateway, functools.partial(
                httpx2.post, gateway.url + CHAT, content=body, trust_env=False, timeout=120,
                headers={"content-type": "application/json"}))
            assert grown_kib * 1024 < bound * len(body), (prefix, grown_kib // 1024)
            assert len(captured.bodies.pop()) >= len(body) - 100
            time.sleep(0.5)


def test_client_that_never_reads_is_dropped_and_the_replica_request_aborted(fleet: Fleet) -> None:
    # An answer long enough that the engine is still generating when the buffers on the way have filled
    # (~30k tokens) and the write timeout has run out.
    replica = fleet.start_replica(args=[*FAST_REPLICA, "--context-length", "1000000", "--kv-capacity-tokens",
                                        "1000000"])
    gateway = fleet.start_gateway(replica.urls, args=[*FAST_GATEWAY, "--write-timeout-secs", "1"])
    host, port = gateway.url.removeprefix("http://").split(":")
    body = json.dumps(question("tell me everything", max_tokens=900_000, stream=True)).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, then nothing read
        sock.connect((host, int(port)))
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 15
        while metric(replica.url, "replica:aborted_requests_total") < 1:
            assert time.monotonic() < deadline, "the replica still generates for a client that stopped reading"
            time.sleep(0.2)
    assert metric(replica.url, "sglang:num_running_reqs") == 0
    assert metric(gateway.url, "gateway_requests_total", status="499") == 1
    assert backends_of(gateway.url)[0]["in_flight"] == 0
    assert "stopped reading" in gateway.log_tail()


def sse_data(raw: bytes) -> list[str]:
    return [line[len("data: "):] for line in raw.decode().splitlines() if line.startswith("data: ")]


async def stream(url: str, max_tokens: int) -> bytes:
    """A streamed chat answer as the client received it (until the server closed the connection)."""
    body = question(max_tokens=max_tokens, stream=True)
    async with aiohttp.ClientSession() as session, session.post(url + CHAT, json=body) as response:
        assert response.status == 200
        chunks = []
        try:
            async for chunk in response.content.iter_any():
                chunks.append(chunk)
        except aiohttp.ClientPayloadError:
            chunks.append(b"\n<cut>")
        return b"".join(chunks)


def test_sigterm_drains_short_streams_and_ends_long_ones_with_an_error_event(fleet: Fleet) -> None:
    replica = fleet.start_replica(args=["--time-scale", "1.0", "--log-level", "warning"])  # ~150 tokens/s
    gateway = fleet.start_gateway(replica.urls, args=[*FAST_GATEWAY, "--log-level", "info",
                                                      "--shutdown-grace-secs", "2"])

    async def shut_down_during_streams() -> tuple[bytes, bytes, float]:
        short = asyncio.ensure_future(stream(gateway.url, 100))     # ~0.7 s: within the grace
        long_ = asyncio.ensure_future(stream(gateway.url, 3000))    # ~20 s: beyond it
        await asyncio.sleep(0.3)
        gateway.popen.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        try:  # a load balancer's probe: refused (no longer listening) or 503, never 200
            async with aiohttp.ClientSession() as session, session.get(gateway.url + "/ready") as ready:
                assert ready.status == 503
        except aiohttp.ClientConnectorError:
            pass
        started = time.monotonic()
        return await short, await long_, time.monotonic() - started

    short, long_, waited_s = asyncio.run(shut_down_during_streams())
    assert sse_data(short)[-1] == "[DONE]"
    assert json.loads(sse_data(long_)[-1])["error"]["code"] == "shutting_down"
    assert waited_s < 4
    gateway.popen.wait(timeout=10)
    log = gateway.log_tail(max_chars=20_000)
    assert "status=200 error=shutdown" in log
    assert "Traceback" not in log and "CancelledError" not in log


def ready_status(url: str) -> tuple[int, bool] | None:
    """/ready's status and its `stopping`, or None when nothing listens on the port any more."""
    try:
        answer = httpx2.get(url + "/ready", trust_env=False, timeout=5)
    except httpx2.ConnectError:
        return None
    return answer.status_code, answer.json()["stopping"]


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.skipif(
    not redis_installed(), reason="--workers 2 starts a private redis-server, which is not installed"))])
def test_sigterm_turns_ready_503_while_still_serving_for_the_delay_then_closes_the_port(fleet: Fleet,
                                                                                          workers: int) -> None:
    replica = fleet.start_replica(args=FAST_REPLICA)
    gateway = fleet.start_gateway(replica.urls, args=[*FAST_GATEWAY, "--shutdown-delay-secs", "2",
                                                      "--workers", str(workers)])
    assert ready_status(gateway.url) == (200, False)
    gateway.popen.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # the supervisor passes the signal on to its workers every 0.2 s
    # Every worker says so (new connections are spread over them), and still serves.
    assert {ready_status(gateway.url) for _ in range(6)} == {(503, True)}
    served = httpx2.post(gateway.url + CHAT, json=question(), trust_env=False, timeout=30)
    assert served.status_code == 200, served.text
    deadline = time.monotonic() + 10
    while ready_status(gateway.url) is not None:  # then the port closes
        assert time.monotonic() < deadline, "the gateway still listens long after the delay"
        time.sleep(0.1)
    assert gateway.popen.wait(timeout=10) == 0


def open_idle(url: str, count: int) -> list[socket.socket]:
    """`count` connections that send nothing."""
    host, port = url.removeprefix("http://").split(":")
    return [socket.create_connection((host, int(port)), timeout=5) for _ in range(count)]


def closed_by_peer(connections: list[socket.socket], wait_s: float = 0.5) -> list[bool]:
    """Which of `connections` the other end closed within `wait_s` (an open idle one has nothing to read)."""
    time.sleep(wait_s)
    readable = set(select.select(connections, [], [], 0)[0])
    return [sock in readable and sock.recv(1, socket.MSG_PEEK) == b"" for sock in connections]


def test_connections_beyond_the_cap_are_closed_at_once_while_requests_are_served(fleet: Fleet) -> None:
    replica = fleet.start_replica(args=FAST_REPLICA)
    gateway = fleet.start_gateway(replica.urls, args=[*FAST_GATEWAY, "--max-connections", "6",
                                                      "--log-level", "info"])
    idle = open_idle(gateway.url, 5)
    try:
        with httpx2.Client(trust_env=False, timeout=30) as client:  # the sixth connection: still served
            assert client.post(gateway.url + CHAT, json=question()).status_code == 200
            assert client.get(gateway.url + "/ready").status_code == 200
        time.sleep(0.2)  # its close reaches the gateway
        more = open_idle(gateway.url, 5)
        idle += more
        assert closed_by_peer(more) == [False, True, True, True, True]
        assert closed_by_peer(idle[:5], wait_s=0) == [False] * 5  # those under the cap stay open
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.2)
    assert httpx2.post(gateway.url + CHAT, json=question(), trust_env=False, timeout=30).status_code == 200
    assert metric(gateway.url, "gateway_client_connections_refused_total") == 4
    assert metric(gateway.url, "gateway_client_connections_max") == 6
    assert gateway.log_tail(20_000).count("the cap (--max-connections)") == 1  # once per interval


def test_api_keys_from_flag_file_and_environment_guard_every_route_but_the_probes(fleet: Fleet) -> None:
    replica = fleet.start_replica(args=FAST_REPLICA)
    with tempfile.NamedTemporaryFile("w", suffix=".keys", delete=False) as key_file:
        key_file.write("# client keys\nfile-key\n")
    try:
        gateway = fleet.start_gateway(replica.urls, args=[*FAST_GATEWAY, "--api-key", "flag-key", "--api-key-file",
                                                          key_file.name, "--admin-api-key", "admin-key"],
                                      env={**os.environ, "PREFIX_GATEWAY_API_KEYS": "env-key, other-env-key"})
    finally:
        os.remove(key_file.name)

    def post(key: str | None) -> httpx2.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx2.post(gateway.url + CHAT, json=question(), headers=headers, trust_env=False, timeout=30)

    refused = post(None)
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert refused.json() == {"error": {"message": refused.json()["error"]["message"],
                                        "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    assert post("not-a-key").status_code == 401
    assert [post(key).status_code for key in ("flag-key", "file-key", "env-key", "other-env-key")] == [200] * 4
    assert httpx2.get(gateway.url + "/health", trust_env=False).status_code == 200
    assert httpx2.get(gateway.url + "/ready", trust_env=False).status_code == 200
    for key, expected in ((None, 401), ("flag-key", 401), ("admin-key", 200)):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        assert httpx2.get(gateway.url + "/metrics", headers=headers, trust_env=False).status_code == expected


def test_client_credentials_are_not_forwarded_and_the_backend_key_is(fleet: Fleet) -> None:
    with capture_backend() as (backend_url, captured), \
            tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as config:
        config.write(f'[[backends]]\nurl = "{backend_url}"\nname = "gpu-a"\napi_key = "backend-secret"\n')
        config.close()
        gateway = fleet.start_gateway([], args=[*FAST_GATEWAY, "--config", config.name, "--expose-backend-urls",
                                                "false"])
        os.remove(config.name)
        response = httpx2.post(gateway.url + CHAT + "?trace=1", json=question(), trust_env=False, timeout=30,
                               headers={"Authorization": "Bearer client-secret", "Cookie": "session=abc",
                                        "Connection": "keep-alive, x-hop-secret", "x-hop-secret": "1",
                                        "X-Forwarded-For": "6.6.6.6", "x-request-id": "r" * 1000})
    assert response.status_code == 200 and response.headers["x-gateway-backend"] == "gpu-a"
    received = captured.headers[0]
    assert received["authorization"] == "Bearer backend-secret"
    assert "cookie" not in received and "x-hop-secret" not in received
    assert received["x-forwarded-for"] == "127.0.0.1" and received["forwarded"] == "for=127.0.0.1"
    assert len(received["x-request-id"]) <= 128 and response.headers["x-request-id"] == received["x-request-id"]
    assert captured.paths[0] == CHAT + "?trace=1"


def test_bad_input_is_4xx_in_openai_shape_and_the_gateway_still_serves(fleet: Fleet) -> None:
    replica = fleet.start_replica(args=FAST_REPLICA)
    gateway = fleet.start_gateway(replica.urls, args=[*FAST_GATEWAY, "--max-body-bytes", "300000"])
    bad = {
        b"{": 400,                                                            # not JSON
        b"[" * 100_000 + b"]" * 100_000: 400,                                  # nested past the parser
        b'{"messages": [{"role": "user", "content": ' + b"[" * 900 + b"]" * 900 + b"}]}": 200,  # deep, but fine
        b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "model": "\\udfff"}': 404,  # lone surrogates
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1' + b"0" * 5000 + b"}": 400,  # huge
        b'{"messages": "hi"}': 400,                                           # wrong type
        json.dumps(question("x" * 310_000)).encode(): 413,                     # over --max-body-bytes
    }
    with httpx2.Client(trust_env=False, timeout=30) as client:
        for raw, expected in bad.items():
            response = client.post(gateway.url + CHAT, content=raw, headers={"content-type": "application/json"})
            assert response.status_code == expected, (raw[:80], response.text[:300])
            if expected >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert client.post(gateway.url + CHAT, json=question()).status_code == 200
    assert backends_of(gateway.url)[0]["in_flight"] == 0
    assert "Traceback" not in gateway.log_tail(max_chars=50_000)
