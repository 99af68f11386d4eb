"""What a new user meets first: the demo on a busy port, the demo's log, the no-model error."""

import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.errors import BadRequest
from gateway.fleet.backends import BackendSpec, Pool
from simulator.fleet import LOOPBACK, Fleet, FleetError, Process, check_port_free


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something else listens on, as another gateway would."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_demo_on_a_busy_port_fails_at_once_and_says_why(busy_port: int) -> None:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "gateway", "demo", "--port", str(busy_port)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"port {busy_port} on 127.0.0.1 is already in use" in result.stderr
    assert "ready at" not in result.stdout and "starting" not in result.stdout  # nothing was started
    assert time.monotonic() - started < 30


def test_gateway_asked_for_a_busy_port_is_refused_before_it_starts(busy_port: int) -> None:
    with pytest.raises(FleetError, match="already in use"):
        check_port_free(busy_port)
    fleet = Fleet()
    with pytest.raises(FleetError, match="already in use"):
        fleet.start_gateway(["http://127.0.0.1:1"], port=busy_port)
    assert fleet.processes == []


def test_a_log_the_user_was_pointed_at_survives_the_fleets_stop() -> None:
    fleet = Fleet()
    for keep in (True, False):
        with tempfile.NamedTemporaryFile(suffix=".log", delete=False) as log:
            popen = subprocess.Popen(["sleep", "30"], start_new_session=True)
        fleet.processes.append(Process("sleeper", [], popen, log.name, keep_log=keep))
    kept, removed = (Path(process.log_path) for process in fleet.processes)
    fleet.stop()
    assert kept.exists() and not removed.exists()
    kept.unlink()


def test_no_model_error_names_embedding_models_apart() -> None:
    pool = Pool([BackendSpec("http://a:1", model="chat-model"), BackendSpec("http://b:1", model="embed-model")],
                index_capacity_blocks=10, retry_after_s=1)
    pool.backends[1].embedding = True
    with pytest.raises(BadRequest) as raised:
        pool.resolve_model(None, None)
    assert "this gateway serves chat-model (embedding models: embed-model)" in str(raised.value)
