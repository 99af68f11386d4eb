"""Start and stop the processes of a test or benchmark fleet: simulated replicas, the gateway, sglang-router, smg.

Shared by the end-to-end tests, the load-test runner and `prefix-gateway demo`, so all three start real
processes on loopback the same way: free ports, a bounded wait for readiness, and a stop that never leaves a
process behind (SIGTERM to the process group, then SIGKILL).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

import httpx2

from gateway.fleet.upstream import PROXY_VARIABLES

LOOPBACK = "127.0.0.1"


class FleetError(RuntimeError):
    """A process of the fleet did not start; the message carries the tail of its log."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def check_port_free(port: int, host: str = LOOPBACK) -> None:
    """Raise FleetError when `port` is taken. Readiness is judged by answers on the port, so a server already
    there (another gateway, say) would otherwise pass for ours while ours exits with "address in use"."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is not "taken"
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise FleetError(f"port {port} on {host} is already in use ({exc.strerror}); "
                             f"stop what listens there or choose another port") from None


def env_without_proxies(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment minus proxy variables, for peers that would send loopback traffic through a proxy."""
    env = dict(os.environ if base is None else base)
    for name in PROXY_VARIABLES:
        env.pop(name, None)
        env.pop(name.lower(), None)
    env["NO_PROXY"] = env["no_proxy"] = f"{LOOPBACK},localhost"
    return env


@dataclass
class Process:
    name: str
    urls: list[str]
    popen: subprocess.Popen[bytes]
    log_path: str
    killed: bool = False  # by kill(): a crash we caused, not one to keep the log of
    keep_log: bool = False  # a log someone was told about (the demo's gateway): kept when the fleet stops

    @property
    def url(self) -> str:
        return self.urls[0]

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """Crash the process at once (SIGKILL), as a failing replica would."""
        self.killed = True
        self._signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def stop(self, timeout_s: float = 10.0) -> None:
        if not self.alive():
            return
        self._signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def remove_log(self) -> None:
        with suppress(OSError):
            os.remove(self.log_path)

    def log_tail(self, max_chars: int = 3000) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as log:
                return log.read()[-max_chars:]
        except OSError:
            return ""

    def _signal(self, signum: int) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signum)


def start_process(
    name: str,
    argv: Sequence[str],
    urls: Sequence[str],
    *,
    ready_path: str | None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 60.0,
    preexec_fn: Callable[[], None] | None = None,
) -> Process:
    """Start `argv` in its own process group and wait until `ready_path` answers 200 at every URL (None: until
    a Redis server answers PING at the URL's port)."""
    with tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False) as log:
        popen = subprocess.Popen(
            list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None, start_new_session=True, preexec_fn=preexec_fn,
        )
    process = Process(name, list(urls), popen, log.name)
    try:
        if ready_path is None:
            wait_redis(process, timeout_s)
        else:
            wait_ready(process, [url + ready_path for url in urls], timeout_s)
    except FleetError:
        process.stop()  # its log stays: the error names it
        raise
    except BaseException:  # interrupted while waiting
        process.stop()
        process.remove_log()
        raise
    return process


def wait_ready(process: Process, ready_urls: Sequence[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(ready_urls)
    with httpx2.Client(trust_env=False, timeout=2.0) as client:
        while pending:
            if not process.alive():
                raise FleetError(f"{process.name} exited with {process.popen.returncode} ({process.log_path}):\n"
                                 f"{process.log_tail()}")
            if time.monotonic() > deadline:
                raise FleetError(f"{process.name} not ready after {timeout_s:.0f} s at {pending[0]} "
                                 f"({process.log_path}):\n{process.log_tail()}")
            try:
                if client.get(pending[0]).status_code == 200:
                    pending.pop(0)
                    continue
            except httpx2.HTTPError:
                pass
            time.sleep(0.1)


def wait_redis(process: Process, timeout_s: float) -> None:
    port = int(process.url.rsplit(":", 1)[1].split("/")[0])
    deadline = time.monotonic() + timeout_s
    while not redis_answers(port):
        if not process.alive():
            raise FleetError(f"{process.name} exited with {process.popen.returncode} ({process.log_path}):\n"
                             f"{process.log_tail()}")
        if time.monotonic() > deadline:
            raise FleetError(f"{process.name} not answering after {timeout_s:.0f} s ({process.log_path})")
        time.sleep(0.05)


def redis_answers(port: int) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def redis_installed() -> bool:
    return shutil.which("redis-server") is not None


def base_url(port: int) -> str:
    return f"http://{LOOPBACK}:{port}"


@dataclass
class Fleet:
    """The processes of one run; `stop()` (or leaving `running_fleet()`) ends all of them."""

    processes: list[Process] = field(default_factory=list)

    def start_replicas(self, count: int, *, args: Sequence[str] = (), name: str = "replicas",
                       ports: Sequence[int] = ()) -> Process:
        """`count` simulated replicas served from one process (cheap on 2 cores); returns it with its URLs.
        Give the `ports` of stopped ones to restart them where they were."""
        ports = list(ports) or [free_port() for _ in range(count)]
        argv = [sys.executable, "-m", "simulator.replica", "--ports", ",".join(map(str, ports)), *args]
        process = start_process(name, argv, [base_url(port) for port in ports], ready_path="/health")
        self.processes.append(process)
        return process

    def start_replica(self, *, args: Sequence[str] = (), name: str = "replica", port: int | None = None) -> Process:
        """One replica in its own process, so a test can kill it alone (and restart it on its `port`)."""
        return self.start_replicas(1, args=args, name=name, ports=[port] if port else [])

    def start_gateway(self, backends: Sequence[str], *, args: Sequence[str] = (),
                      env: Mapping[str, str] | None = None, name: str = "gateway",
                      ready_path: str = "/ready", port: int | None = None,
                      preexec_fn: Callable[[], None] | None = None) -> Process:
        """The gateway in front of `backends`; `ready_path="/health"` for one that is not meant to be ready.
        A `port` asked for must be free (FleetError otherwise); without one a free port is picked. `preexec_fn`
        runs in the child before it starts (to set resource limits, say)."""
        if port:
            check_port_free(port)
        port = port or free_port()
        # Tests and benchmarks compare x-gateway-backend with the replicas' URLs.
        argv = [sys.executable, "-m", "gateway", "serve", "--host", LOOPBACK, "--port", str(port),
                "--expose-backend-urls", "true"]
        for backend in backends:
            argv += ["--backend", backend]
        process = start_process(name, [*argv, *args], [base_url(port)], ready_path=ready_path, env=env,
                                preexec_fn=preexec_fn)
        self.processes.append(process)
        return process

    def start_redis(self, *, port: int | None = None, name: str = "redis") -> Process:
        """A private redis-server on loopback, without persistence, for gateway instances sharing state; its URL
        is `redis://127.0.0.1:PORT/0`. Give the port of a killed one to restart it empty."""
        port = port or free_port()
        argv = ["redis-server", "--port", str(port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no"]
        process = start_process(name, argv, [f"redis://{LOOPBACK}:{port}/0"], ready_path=None, timeout_s=20.0)
        self.processes.append(process)
        return process

    def start_gateways(self, count: int, backends: Sequence[str], *, args: Sequence[str] = (),
                       state: str | None = None) -> list[Process]:
        """`count` gateway instances in front of the same backends, sharing `state` (a Redis URL) when given."""
        shared = ["--state", state] if state else []
        return [self.start_gateway(backends, args=[*args, *shared], name=f"gateway-{i + 1}") for i in range(count)]

    def start_sglang_router(self, backends: Sequence[str], *, policy: str = "cache_aware",
                            args: Sequence[str] = ()) -> Process:
        """SGLang's own router in front of the same kind of fleet (it needs the proxy variables cleared)."""
        port, metrics_port = free_port(), free_port()
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", LOOPBACK, "--port", str(port),
                "--policy", policy, "--prometheus-host", LOOPBACK, "--prometheus-port", str(metrics_port),
                "--worker-urls", *backends, *args]
        process = start_process("sglang-router", argv, [base_url(port)], ready_path="/readiness",
                                env=env_without_proxies(), timeout_s=120.0)
        self.processes.append(process)
        return process

    def start_smg(self, backends: Sequence[str], *, policy: str = "cache_aware") -> Process:
        """The Shepherd Model Gateway (`pip install smg`) in front of `backends`, run as `-m smg.cli`: sglang-router
        also installs an `smg` command, which is sglang-router itself."""
        port, metrics_port = free_port(), free_port()
        argv = [sys.executable, "-m", "smg.cli", "launch", "--host", LOOPBACK, "--port", str(port),
                "--worker-urls", *backends, "--policy", policy,
                "--prometheus-host", LOOPBACK, "--prometheus-port", str(metrics_port)]
        process = start_process("smg", argv, [base_url(port)], ready_path="/health", env=env_without_proxies(),
                                timeout_s=120.0)
        self.processes.append(process)
        return process

    def stop(self, keep_logs: bool = False) -> None:
        """Stop every process. A log is kept (and its path printed) when its process had died on its own or
        `keep_logs` is set; the others are removed, so that runs do not fill the temporary directory."""
        for process in reversed(self.processes):
            died = not process.alive() and not process.killed
            process.stop()
            if died or keep_logs or process.keep_log:
                print(f"{process.name} log kept: {process.log_path}", file=sys.stderr)
            else:
                process.remove_log()
        self.processes.clear()


@contextmanager
def running_fleet() -> Iterator[Fleet]:
    """A fleet stopped on leaving; when leaving on an error (not an interrupt), every log is kept."""
    fleet = Fleet()
    try:
        yield fleet
    except Exception:
        fleet.stop(keep_logs=True)
        raise
    finally:
        fleet.stop()  # nothing left to stop after the error path
