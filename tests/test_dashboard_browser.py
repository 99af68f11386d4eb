"""/dashboard in a real headless Chromium, against a real gateway in front of simulated replicas."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from simulator.fleet import Fleet
from tests.browser import Browser, headless_chromium, missing
from tests.conftest import FAST_GATEWAY

pytestmark = pytest.mark.skipif(missing() is not None, reason=f"no browser: {missing()}")

SYSTEM = "You are the assistant of a bookshop; answer in one short sentence. " * 30
# Every number the page shows, by backend row and tile, as text.
READ_NUMBERS = """
const rows = {};
for (const row of document.querySelectorAll('#backends tr[data-backend]')) {
  rows[row.dataset.backend] = Object.fromEntries(
    [...row.querySelectorAll('[data-field]')].map((cell) => [cell.dataset.field, cell.textContent]));
}
return {rows, requests: document.getElementById('fleet-requests').textContent,
        polls: Number(document.getElementById('status').dataset.polls || 0)};
"""


def send_load(gateway: str, stop: threading.Event, client: int) -> None:
    i = 0
    while not stop.is_set():
        i += 1
        system = SYSTEM if client % 2 else f"Topic {client}. " * 200
        body = {"model": "sim-llama-8b", "max_tokens": 16,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Q{i}?"}]}
        with contextlib.suppress(httpx2.TransportError):  # the page's numbers are under test, not this request
            httpx2.post(gateway + "/v1/chat/completions", json=body, timeout=30, trust_env=False)


@pytest.fixture
def load(fleet: Fleet) -> Iterator[tuple[str, list[str], threading.Event]]:
    """A gateway in front of three replicas, and a switch that starts four clients sending chats to it."""
    replicas = fleet.start_replicas(3, args=["--time-scale", "0.05", "--log-level", "warning"])
    gateway = fleet.start_gateway(replicas.urls, args=FAST_GATEWAY)
    go, stop = threading.Event(), threading.Event()

    def client(number: int) -> None:
        if go.wait(60):
            send_load(gateway.url, stop, number)

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(4)]
    for thread in threads:
        thread.start()
    yield gateway.url, replicas.urls, go
    stop.set()
    go.set()
    for thread in threads:
        thread.join(timeout=30)


@pytest.fixture
def browser() -> Iterator[Browser]:
    with headless_chromium() as started:
        yield started


def test_dashboard_shows_every_backend_and_updates_while_load_runs(
        load: tuple[str, list[str], threading.Event], browser: Browser, tmp_path: Path) -> None:
    gateway, replicas, go = load
    browser.open(gateway + "/dashboard")
    idle = browser.wait_for(f"const n = (() => {{{READ_NUMBERS}}})(); return n.polls >= 1 && n;")
    assert sorted(idle["rows"]) == sorted(replicas)
    assert all(row["requests_per_s"] == "0.0" for row in idle["rows"].values())

    go.set()
    busy = browser.wait_for(f"""const n = (() => {{{READ_NUMBERS}}})();
        return Object.values(n.rows).some((row) => row.requests_per_s !== '0.0') && n.polls >= 3 && n;""")
    assert busy["requests"] != idle["requests"]
    assert any(row["reported_hit_rate"].endswith("%") for row in busy["rows"].values())
    browser.wait_for("return document.querySelectorAll('#mix-legend [data-route]').length > 0")
    browser.screenshot(Path(os.environ.get("DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png")))
