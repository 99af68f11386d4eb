"""Fixtures that start real fleets on loopback: simulated replicas and the gateway, as separate processes.
`async def` tests run in a fresh event loop each (the in-process request-path tests, tests/inprocess.py)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterator

import pytest

from simulator.fleet import Fleet, running_fleet

# Simulated engines run 100x faster than a real GPU, so a test's generations take milliseconds.
FAST_REPLICA = ["--time-scale", "0.01", "--log-level", "warning"]
# Quick health checks so a killed or recovered replica is noticed within a test's patience.
FAST_GATEWAY = ["--health-check-interval-secs", "0.2", "--health-check-timeout-secs", "1",
                "--log-level", "warning"]


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run a coroutine test to its end in its own loop; no plugin needed for a handful of async tests."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    arguments = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    asyncio.run(pyfuncitem.obj(**arguments))
    return True


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
