"""Several gateway processes (and, for load, in-process instances) sharing state through a real redis-server."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from gateway.fleet.backends import BackendSpec, RemoteLoad
from gateway.fleet.pool import Pool
from gateway.fleet.shared_state import KEY_PREFIX, LOAD_TTL_S, PLACED, SharedState, backend_id, encode_update
from simulator.fleet import Fleet, Process, redis_installed, running_fleet
from tests.conftest import FAST_GATEWAY, FAST_REPLICA

pytestmark = pytest.mark.skipif(not redis_installed(), reason="redis-server is not installed "
                                "(apt-get install redis-server); .ci/run installs it")

SYSTEM = "You are the support assistant of a bookshop. Answer politely and precisely. " * 40  # ~3,000 chars
SHARING_PATIENCE_S = 5.0  # far above the measured publish-to-apply delay (tens of ms), for a loaded machine


def chat(gateway: str, system: str, question: str) -> httpx2.Response:
    body = {"model": "sim-llama-8b", "max_tokens": 4,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    return httpx2.post(gateway + "/v1/chat/completions", json=body, timeout=30, trust_env=False)


def state_of(gateway: str) -> tuple[int, dict[str, Any]]:
    response = httpx2.get(gateway + "/ready", timeout=5, trust_env=False)
    return response.status_code, response.json()["state"]


def applied(gateway: str) -> int:
    return int(state_of(gateway)[1]["applied_updates"])


def sees_remote_load(gateway: str) -> bool:
    backends = httpx2.get(gateway + "/backends", timeout=5, trust_env=False).json()["backends"]
    return any(b["remote_in_flight"] or b["remote_queued_prefill_tokens"] for b in backends)


def place_and_share(placing: str, others: list[str], system: str) -> str:
    """Send a first request about `system` through `placing`; its backend, once every other instance applied it
    and holds no load of it any more (a flush during the request shares it in flight, so the owner looks busy
    until the next flushes: a second request would rightly spill)."""
    before = [applied(other) for other in others]
    response = chat(placing, system, "first question")
    assert response.status_code == 200
    deadline = time.monotonic() + SHARING_PATIENCE_S
    while any(applied(other) <= count or sees_remote_load(other) for other, count in zip(others, before, strict=True)):
        assert time.monotonic() < deadline, "the placement did not reach every other instance"
        time.sleep(0.02)
    return response.headers["x-gateway-backend"]


def assert_routed_by_prefix(gateway: str, system: str, backend: str) -> httpx2.Response:
    response = chat(gateway, system, "another question")
    assert response.status_code == 200
    assert (response.headers["x-gateway-backend"], response.headers["x-gateway-route"]) == (backend, "prefix")
    return response


@pytest.fixture(scope="module")
def shared_fleet() -> Iterator[tuple[Fleet, Process, list[str], list[Process]]]:
    """A redis-server, three replicas, two gateways sharing state: (fleet, redis, replica URLs, gateways)."""
    with running_fleet() as started:
        redis = started.start_redis()
        replicas = started.start_replicas(3, args=FAST_REPLICA)
        gateways = started.start_gateways(2, replicas.urls, args=FAST_GATEWAY, state=redis.url)
        yield started, redis, replicas.urls, gateways


def test_a_prefix_placed_through_one_instance_is_routed_to_the_same_backend_through_another(
        shared_fleet: tuple[Fleet, Process, list[str], list[Process]]) -> None:
    _, _, _, (first, second) = shared_fleet
    for topic in ("novels", "atlases", "cookbooks"):
        system = f"{topic}: {SYSTEM}"
        owner = place_and_share(first.url, [second.url], system)
        response = assert_routed_by_prefix(second.url, system, owner)
        assert float(response.headers["x-gateway-prefix-match"]) > 0.9
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 500  # a real hit


def test_a_new_instance_holds_the_fleets_placements_when_it_reports_ready(
        shared_fleet: tuple[Fleet, Process, list[str], list[Process]]) -> None:
    fleet, redis, replicas, (first, _) = shared_fleet
    others = [gateway.url for gateway in shared_fleet[3][1:]]
    owners = {topic: place_and_share(first.url, others, f"{topic}: {SYSTEM}")
              for topic in ("maps", "poems", "plays", "essays")}  # in the store, then
    newcomer = fleet.start_gateway(replicas, args=[*FAST_GATEWAY, "--state", redis.url], name="newcomer")
    status, state = state_of(newcomer.url)
    assert status == 200 and state["warmed_updates"] >= len(owners)
    for topic, owner in owners.items():  # at once: from the replayed stream, not from updates arriving later
        assert_routed_by_prefix(newcomer.url, f"{topic}: {SYSTEM}", owner)


class Traffic(threading.Thread):
    """Requests sent round robin over gateways until stopped, counting those that failed."""

    def __init__(self, gateways: list[str]) -> None:
        super().__init__(daemon=True)
        self.gateways = gateways
        self.sent = 0
        self.failed: list[str] = []
        self.slowest_s = 0.0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            gateway = self.gateways[self.sent % len(self.gateways)]
            started = time.monotonic()
            try:
                response = chat(gateway, f"group {self.sent % 5}: {SYSTEM}", f"question {self.sent}")
                self.slowest_s = max(self.slowest_s, time.monotonic() - started)
                if response.status_code != 200:
                    self.failed.append(f"{response.status_code} {response.text[:200]}")
            except httpx2.HTTPError as exc:
                self.failed.append(repr(exc))
            self.sent += 1

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=30)


def wait_for_store(gateways: list[Process], up: bool, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(state_of(g.url)[1]["up"] is not up for g in gateways):
        assert time.monotonic() < deadline, f"the gateways did not see the store {'up' if up else 'down'}"
        time.sleep(0.1)


def test_redis_killed_mid_run_fails_no_request_and_instances_resynchronise_when_it_returns(fleet: Fleet) -> None:
    redis = fleet.start_redis()
    port = int(redis.url.rsplit(":", 1)[1].split("/")[0])
    replicas = fleet.start_replicas(3, args=FAST_REPLICA)
    gateways = fleet.start_gateways(2, replicas.urls, args=FAST_GATEWAY, state=redis.url)
    traffic = Traffic([g.url for g in gateways])
    traffic.start()
    time.sleep(0.5)
    redis.kill()
    wait_for_store(gateways, up=False)
    sent_while_down = traffic.sent
    first, second = gateways
    during = chat(first.url, f"during the outage: {SYSTEM}", "a question").headers["x-gateway-backend"]
    time.sleep(1.0)
    assert traffic.sent > sent_while_down  # requests kept flowing with the store gone
    assert all(state_of(g.url)[0] == 200 for g in gateways)  # and the gateways stayed ready
    fleet.start_redis(port=port)
    wait_for_store(gateways, up=True)
    traffic.stop()
    assert traffic.failed == [] and traffic.sent > 20
    time.sleep(1.0)  # the republished indexes applied, so that what counts below is the new placement
    assert_routed_by_prefix(second.url, f"during the outage: {SYSTEM}", during)  # resynchronised
    owner = place_and_share(first.url, [second.url], f"after the outage: {SYSTEM}")
    assert_routed_by_prefix(second.url, f"after the outage: {SYSTEM}", owner)
    for gateway in gateways:  # one line when the store went, one when it came back; not one per request
        log = gateway.log_tail(max_chars=100_000)
        assert log.count("unreachable") == 1 and log.count("answers again") == 1


def test_a_store_that_stops_answering_delays_no_request(fleet: Fleet) -> None:
    redis = fleet.start_redis()
    replicas = fleet.start_replicas(3, args=FAST_REPLICA)
    gateways = fleet.start_gateways(2, replicas.urls, args=FAST_GATEWAY, state=redis.url)
    traffic = Traffic([g.url for g in gateways])
    traffic.start()
    time.sleep(0.5)
    os.kill(redis.popen.pid, signal.SIGSTOP)  # accepts connections, answers nothing
    try:
        wait_for_store(gateways, up=False)
        time.sleep(1.0)
    finally:
        os.kill(redis.popen.pid, signal.SIGCONT)
    wait_for_store(gateways, up=True)
    traffic.stop()
    assert traffic.failed == [] and traffic.sent > 20
    assert traffic.slowest_s < 0.5  # the store's 1 s timeout never reached a request


def test_each_instance_counts_the_load_the_others_put_on_a_backend_until_they_stop(fleet: Fleet) -> None:
    redis = fleet.start_redis()
    specs = [BackendSpec(f"http://10.0.0.{i}:8000", model="m") for i in range(2)]
    pools = [Pool(specs, 1000, retry_after_s=1) for _ in range(3)]

    async def run() -> tuple[list[RemoteLoad], list[RemoteLoad]]:
        states = [SharedState(redis.url, pool, CollectorRegistry()) for pool in pools]
        for state in states:
            await state.start()
        pools[0].backends[1].in_flight = 3
        pools[1].backends[1].in_flight = 2
        await asyncio.sleep(0.5)
        seen = [pools[2].backends[0].remote, pools[2].backends[1].remote]
        await states[0].stop()
        await states[1].stop()
        await asyncio.sleep(LOAD_TTL_S + 0.5)
        after = [pools[2].backends[0].remote, pools[2].backends[1].remote]
        await states[2].stop()
        return seen, after

    seen, after = asyncio.run(run())
    assert [load.in_flight for load in seen] == [0, 5]
    assert after == [RemoteLoad(), RemoteLoad()]  # stopped instances' load expired


def test_an_entry_in_another_format_is_skipped_and_the_next_applied(fleet: Fleet) -> None:
    redis = fleet.start_redis()
    pool = Pool([BackendSpec("http://10.0.0.1:8000", model="m")], 1000, retry_after_s=1)

    async def run() -> int:
        writer = aioredis.Redis.from_url(redis.url)
        stream = KEY_PREFIX + "index"
        await writer.xadd(stream, {"something": "else"})
        await writer.xadd(stream, {"i": "other", "t": "1", "b": b"\x01truncated"})
        await writer.xadd(stream, {"i": "other", "t": repr(time.time()),
                                   "b": encode_update(PLACED, backend_id("http://10.0.0.1:8000"), [7, 8, 9])})
        await writer.aclose()
        state = SharedState(redis.url, pool, CollectorRegistry())
        await state.start()
        await state.stop()
        return pool.backends[0].index.match([7, 8, 9])

    assert asyncio.run(run()) == 3
