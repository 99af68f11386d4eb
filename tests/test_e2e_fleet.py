"""Backends at run time with real processes on loopback: a backend file edited while the gateway runs, the admin
API, DNS discovery through a name that resolves on loopback, and a replica restarted on its port."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import httpx2

from simulator.fleet import Fleet, free_port
from tests.conftest import FAST_GATEWAY, FAST_REPLICA

CHAT = "/v1/chat/completions"
SLOW_REPLICA = ["--time-scale", "1.0", "--log-level", "warning"]  # ~150 tokens/s: a 600-token stream takes ~4 s
ADMIN_KEY = "admin-secret"


def backends_of(url: str, path: str = "/backends", key: str | None = None) -> list[dict[str, Any]]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    answer: list[dict[str, Any]] = httpx2.get(url + path, headers=headers, trust_env=False).json()["backends"]
    return answer


def by_url(url: str, key: str | None = None) -> dict[str, dict[str, Any]]:
    return {backend["url"]: backend for backend in backends_of(url, key=key)}


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        time.sleep(0.1)


def chat(gateway: str, content: str = "hello", max_tokens: int = 3) -> httpx2.Response:
    return httpx2.post(gateway + CHAT, json={"messages": [{"role": "user", "content": content}],
                                             "max_tokens": max_tokens}, trust_env=False, timeout=30)


async def stream(url: str, max_tokens: int) -> tuple[str, bytes]:
    """A streamed chat answer: the backend that served it, and all the client received."""
    body = {"messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": max_tokens,
            "stream": True}
    async with aiohttp.ClientSession() as session, session.post(url + CHAT, json=body) as response:
        assert response.status == 200
        return response.headers["x-gateway-backend"], await response.read()


def sse_data(raw: bytes) -> list[str]:
    return [line[len("data: "):] for line in raw.decode().splitlines() if line.startswith("data: ")]


def test_backend_file_edits_add_and_remove_backends_and_a_removed_ones_stream_finishes(
        fleet: Fleet, tmp_path: Path) -> None:
    fast = fleet.start_replica(args=FAST_REPLICA, name="fast")
    slow = fleet.start_replica(args=SLOW_REPLICA, name="slow")
    listing = tmp_path / "backends.txt"
    listing.write_text(f"# the fleet\n{fast.url}\n")
    gateway = fleet.start_gateway([], args=[*FAST_GATEWAY, "--backend-file", str(listing), "--log-level", "info"])
    assert list(by_url(gateway.url)) == [fast.url]

    listing.write_text(f"{fast.url}\n{slow.url}  # added\n")
    wait_for(lambda: by_url(gateway.url).get(slow.url, {}).get("healthy") is True, "the added backend joins")
    listing.write_text(f"{slow.url}\n")
    wait_for(lambda: fast.url not in by_url(gateway.url), "the removed idle backend leaves")

    async def remove_while_streaming() -> tuple[str, bytes, dict[str, Any]]:
        streaming = asyncio.ensure_future(stream(gateway.url, 600))
        await asyncio.sleep(0.5)
        listing.write_text(f"{fast.url}\n")
        deadline = time.monotonic() + 5
        while not by_url(gateway.url)[slow.url]["draining"]:  # still listed: its stream is in flight
            assert time.monotonic() < deadline, "the backend does not drain"
            await asyncio.sleep(0.1)
        seen = by_url(gateway.url)[slow.url]
        backend, raw = await streaming
        return backend, raw, seen

    backend, raw, draining = asyncio.run(remove_while_streaming())
    assert backend == slow.url and draining["in_flight"] == 1
    assert sse_data(raw)[-1] == "[DONE]" and len(sse_data(raw)) > 100  # the whole answer, not a cut one
    wait_for(lambda: list(by_url(gateway.url)) == [fast.url], "the drained backend leaves, the other is back")
    wait_for(lambda: by_url(gateway.url)[fast.url]["healthy"], "the re-added backend passes its check")
    answer = chat(gateway.url)
    assert answer.status_code == 200 and answer.headers["x-gateway-backend"] == fast.url
    metrics = httpx2.get(gateway.url + "/metrics", trust_env=False).text
    assert f'backend="{slow.url}"' not in metrics  # its series left with it
    assert "removed" in gateway.log_tail(max_chars=50_000)


def test_admin_api_lists_adds_drains_and_removes_backends_with_the_admin_key(fleet: Fleet) -> None:
    first, second = fleet.start_replica(args=FAST_REPLICA), fleet.start_replica(args=FAST_REPLICA)
    admin_port = free_port()
    gateway = fleet.start_gateway(first.urls, args=[*FAST_GATEWAY, "--policy", "round_robin",
                                                    "--admin-port", str(admin_port), "--admin-api-key", ADMIN_KEY])
    admin = f"http://127.0.0.1:{admin_port}/admin/backends"
    key = {"authorization": f"Bearer {ADMIN_KEY}"}
    with httpx2.Client(trust_env=False, timeout=10) as http:
        refused = http.get(admin)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert http.get(admin, headers={"authorization": "Bearer wrong"}).status_code == 401
        assert http.get(gateway.url + "/admin/backends").status_code == 404  # not on the clients' port
        assert [b["url"] for b in http.get(admin, headers=key).json()["backends"]] == first.urls

        added = http.post(admin, headers=key, json={"url": second.url, "name": "second"})
        assert added.status_code == 201 and added.json()["backend"]["source"] == "admin"
        assert http.post(admin, headers=key, json={"url": second.url}).status_code == 409
        bad = http.post(admin, headers=key, json={"url": "not-a-url"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"
        wait_for(lambda: by_url(gateway.url, ADMIN_KEY)[second.url]["healthy"], "the added backend joins")
        served = {chat(gateway.url, f"question {i}").headers["x-gateway-backend"] for i in range(4)}
        assert served == {first.url, second.url}

        drained = http.post(admin + "/second/drain", headers=key)
        assert drained.status_code == 200 and drained.json()["backend"]["draining"] is True
        served = {chat(gateway.url, f"other question {i}").headers["x-gateway-backend"] for i in range(4)}
        assert served == {first.url}

        removed = http.delete(admin + "/" + quote(second.url, safe=""), headers=key)  # by URL, too
        assert removed.status_code == 202
        wait_for(lambda: list(by_url(gateway.url, ADMIN_KEY)) == first.urls, "the removed backend leaves")
        missing = http.delete(admin + "/second", headers=key)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "backend_not_found"


def loopback_addresses() -> set[str]:
    return {str(info[4][0]) for info in socket.getaddrinfo("localhost", 1, type=socket.SOCK_STREAM)}


def test_dns_discovery_finds_the_replica_behind_localhost(fleet: Fleet) -> None:
    replica = fleet.start_replica(args=FAST_REPLICA)
    port = replica.url.rsplit(":", 1)[1]
    gateway = fleet.start_gateway([], args=[*FAST_GATEWAY, "--backend-dns", f"localhost:{port}",
                                            "--backend-dns-interval-secs", "0.5"])
    found = by_url(gateway.url)
    # localhost is 127.0.0.1, and ::1 too where the machine has IPv6: one backend per address
    assert set(found) == {f"http://{'[' + a + ']' if ':' in a else a}:{port}" for a in loopback_addresses()}
    assert found[replica.url]["healthy"] and found[replica.url]["source"] == f"dns:localhost:{port}"
    answer = chat(gateway.url)
    assert answer.status_code == 200 and answer.headers["x-gateway-backend"] == replica.url


def test_a_replica_restarted_on_its_port_gets_its_index_cleared(fleet: Fleet) -> None:
    replica = fleet.start_replica(args=FAST_REPLICA)
    port = int(replica.url.rsplit(":", 1)[1])
    # Failed checks never take it out here: only the restart itself can clear its index.
    gateway = fleet.start_gateway(replica.urls, args=[*FAST_GATEWAY, "--health-failure-threshold", "1000",
                                                      "--metrics-scrape-interval-secs", "0.2"])
    assert chat(gateway.url, "a prompt long enough to fill a few blocks " * 20).status_code == 200
    wait_for(lambda: by_url(gateway.url)[replica.url]["index_blocks"] > 0, "the prompt is indexed")
    time.sleep(0.5)  # a scrape has read the first start time
    replica.kill()
    time.sleep(1.2)  # the start time moves by more than its tolerance
    fleet.start_replica(args=FAST_REPLICA, port=port)
    wait_for(lambda: by_url(gateway.url)[replica.url]["index_blocks"] == 0, "the index is cleared")
    assert "restarted (its process start time moved" in gateway.log_tail(max_chars=50_000)
    assert json.loads(chat(gateway.url).text)["choices"]
