"""Fixtures that start real fleets on loopback: simulated replicas and the gateway, as separate processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loadtest.fleet import Fleet, running_fleet

# Simulated engines run 100x faster than a real GPU, so a test's generations take milliseconds.
FAST_REPLICA = ["--time-scale", "0.01", "--log-level", "warning"]
# Quick health checks so a killed or recovered replica is noticed within a test's patience.
FAST_GATEWAY = ["--health-check-interval-secs", "0.2", "--health-check-timeout-secs", "1",
                "--log-level", "warning"]


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    with running_fleet() as started:
        yield started


@pytest.fixture(scope="module")
def llm_fleet() -> Iterator[tuple[Fleet, str, list[str]]]:
    """Three replicas of one model behind a prefix_aware gateway: (fleet, gateway URL, replica URLs)."""
    with running_fleet() as started:
        replicas = started.start_replicas(3, args=FAST_REPLICA)
        gateway = started.start_gateway(replicas.urls, args=FAST_GATEWAY)
        yield started, gateway.url, replicas.urls
