"""`--workers N`: several processes on one port, sharing routing state (a private redis-server without --state)."""

from __future__ import annotations

import os
import signal
import time

import httpx2
import pytest

from simulator.fleet import Fleet, redis_installed
from tests.conftest import FAST_GATEWAY, FAST_REPLICA
from tests.test_e2e_shared_state import SYSTEM, chat

pytestmark = pytest.mark.skipif(not redis_installed(), reason="redis-server is not installed "
                                "(apt-get install redis-server); .ci/run installs it")


def test_workers_on_one_port_route_one_prefix_to_one_backend(fleet: Fleet) -> None:
    replicas = fleet.start_replicas(3, args=FAST_REPLICA)
    gateway = fleet.start_gateway(replicas.urls, args=[*FAST_GATEWAY, "--workers", "2"])
    owners = set()
    for i in range(24):  # new connections each time: the kernel spreads them over both workers
        response = chat(gateway.url, SYSTEM, f"question {i}")
        assert response.status_code == 200, response.text
        owners.add(response.headers["x-gateway-backend"])
        if i == 0:
            # The first placement reaches the other worker within a flush or two (README "Several instances"); a
            # loaded CI machine is slower: give it a second, as a client's next turn would.
            time.sleep(1.0)
    # Whichever worker answered, the shared system prompt stayed where it was first placed.
    assert len(owners) == 1
    workers = {httpx2.get(gateway.url + "/ready", trust_env=False).json()["state"]["instance"] for _ in range(20)}
    assert len(workers) == 2


def test_workers_stop_with_their_private_store_on_sigterm(fleet: Fleet) -> None:
    replica = fleet.start_replica(args=FAST_REPLICA)
    gateway = fleet.start_gateway([replica.url], args=[*FAST_GATEWAY, "--workers", "2", "--log-level", "info"])
    assert chat(gateway.url, SYSTEM, "hello").status_code == 200
    os.kill(gateway.popen.pid, signal.SIGTERM)
    assert gateway.popen.wait(30) == 0
    assert "private redis-server" in gateway.log_tail(20000)
