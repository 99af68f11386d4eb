"""What a new user meets first: the demo on a busy port, the demo's log, the no-model error."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from gateway.demo import LLM_MODEL, SYSTEM_PROMPT
from gateway.errors import BadRequest
from gateway.fleet.backends import BackendSpec
from gateway.fleet.pool import Pool
from simulator.fleet import LOOPBACK, Fleet, FleetError, Process, check_port_free, free_port, redis_installed


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


def read_until(popen: subprocess.Popen[str], marker: str, timeout_s: float) -> str:
    """What `popen` printed up to and including the line holding `marker`; it is killed after `timeout_s`."""
    assert popen.stdout is not None
    lines: list[str] = []
    watchdog = threading.Timer(timeout_s, popen.kill)
    watchdog.start()
    try:
        while not any(marker in line for line in lines):
            line = popen.stdout.readline()
            assert line, "".join(lines)  # it exited, or was killed by the watchdog
            lines.append(line)
    finally:
        watchdog.cancel()
    return "".join(lines)


@pytest.mark.skipif(not redis_installed(), reason="--workers 2 needs redis-server (apt-get install redis-server)")
def test_demo_with_workers_shares_routing_state_between_them() -> None:
    port = free_port()
    log_path = Path(os.devnull)
    demo = subprocess.Popen([sys.executable, "-m", "gateway", "demo", "--workers", "2", "--replicas", "2",
                             "--port", str(port)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        banner = read_until(demo, "Ctrl-C stops", timeout_s=90)
        log_path = Path(banner.split("kept after the demo stops): ")[1].split()[0])
        assert "2 gateway processes serve this port and share their routing state" in banner
        url = f"http://{LOOPBACK}:{port}"
        body = {"model": LLM_MODEL, "max_tokens": 4,
                "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Hello!"}]}
        answers = [httpx2.post(url + "/v1/chat/completions", json=body, trust_env=False, timeout=30)]
        # Placements reach the other worker within a flush or two (README "Several instances": p50 <= 50 ms, and
        # a loaded CI machine is slower): give it a second before asking it, as a client's next turn would.
        time.sleep(1.0)
        answers += [httpx2.post(url + "/v1/chat/completions", json=body, trust_env=False, timeout=30)
                    for _ in range(5)]  # a new connection each: the kernel spreads them over both workers
        assert {answer.headers["x-gateway-backend"] for answer in answers} == {answers[0].headers["x-gateway-backend"]}
        assert json.loads(answers[-1].text)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        instances = {httpx2.get(url + "/ready", trust_env=False).json()["state"]["instance"] for _ in range(20)}
        assert len(instances) == 2
        os.killpg(demo.pid, signal.SIGTERM)
        assert demo.wait(30) == 0
    finally:
        if demo.poll() is None:  # SIGTERM: the demo stops its replicas and gateway (their own sessions) first
            os.killpg(demo.pid, signal.SIGTERM)
            try:
                demo.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(demo.pid, signal.SIGKILL)
                demo.wait()
        assert demo.stdout is not None
        demo.stdout.close()
    if log_path != Path(os.devnull):
        log_path.unlink()  # the demo keeps it for its user


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
