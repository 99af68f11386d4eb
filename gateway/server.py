"""Serving the app: aiohttp's server, one process per worker, all on one port.

aiohttp serves the gateway (it replaced uvicorn and Starlette here; README, "Overhead" has the measurement).
What it gives a gateway that must not be knocked over by its clients: header lines and fields capped at 8 KiB
and 128 headers (400 above), a connection that has not completed a request within the keep-alive timeout is
closed (slow-header clients cannot hold it), a client that leaves cancels its handler (and so the backend's
request), and a shutdown that stops accepting, runs `Gateway.on_shutdown` (the grace period), then cancels
what is left. Here: open connections are capped (gateway/api/connections.py), and on SIGTERM /ready answers 503
for `--shutdown-delay-secs` while the port still serves, before that shutdown. Several workers share the port
with SO_REUSEPORT; the kernel spreads connections over them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import resource
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from types import FrameType

from aiohttp import web, web_protocol

from gateway.api.connections import ConnectionCap, default_max_connections
from gateway.app import GATEWAY, create_app, skip_the_router_for_relays
from gateway.config import GatewayConfig
from gateway.errors import ConfigError

logger = logging.getLogger(__name__)

_RESPAWN_PAUSE_S = 1.0
# Young collections every this many container allocations instead of Python's 700 (see `tune_gc`).
YOUNG_GC_THRESHOLD = 10_000


def raise_open_file_limit() -> int:
    """Lift the soft limit on open files to the hard one: each relayed request holds two sockets, and the
    usual soft limit of 1,024 would cap the gateway at a few hundred concurrent requests."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return soft
        return hard
    return soft


def bound_request_queue() -> None:
    """Let aiohttp queue at most 2 parsed request heads per connection (it queues 32 before it pauses reading).

    A client flooding a header past the 8 KiB limit turns every further read (256 KiB) into one more queued
    400 carrying a copy of the data until the first 400 is sent: ~16 MB per connection at 32, so ten such
    clients grew the gateway by 100+ MB a round, kept by the allocator. At 2 the queue is flow control for
    pipelined requests still, and reading resumes as it drains. The constant is aiohttp's own (private):
    should it go away, this does nothing."""
    if hasattr(web_protocol, "MAX_MSG_QUEUE_SIZE"):
        web_protocol.MAX_MSG_QUEUE_SIZE = 2


async def tune_gc(app: web.Application) -> None:
    """Keep the cyclic garbage collector off the request path; run once the app has started.

    With Python's defaults it cost about 40 us of CPU per relayed request, a tenth of the total: a young
    collection every 700 container allocations traverses the live state of every request in flight (a request
    allocates ~90 of them), and each full collection rescans the ~55,000 objects built at start (modules, the
    app, the fleet), which never become garbage. Those are frozen out of collection, and young collections
    run every `YOUNG_GC_THRESHOLD` allocations: the gateway's requests make almost no cycles (about one per
    four requests), and refcounting frees everything else at once, so little waits longer for collection."""
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GC_THRESHOLD, older, oldest)


def serve_worker(config: GatewayConfig, reuse_port: bool) -> None:
    """Run one gateway process until SIGTERM or SIGINT."""
    try:
        import uvloop
        uvloop.install()
    except ImportError:  # uvloop is optional off CPython/Linux; asyncio's loop works, only slower
        pass
    bound_request_queue()
    open_files = raise_open_file_limit()
    if open_files < 2 * config.max_concurrent_requests + 64:
        logger.warning("open-file limit %d is low for --max-concurrent-requests %d (each request holds two "
                       "sockets)", open_files, config.max_concurrent_requests)
    max_connections = config.max_connections or default_max_connections(open_files)
    asyncio.run(run_worker(config, reuse_port, max_connections))


async def run_worker(config: GatewayConfig, reuse_port: bool, max_connections: int) -> None:
    """Serve until a stop signal; then /ready answers 503 while the port stays open for
    `shutdown_delay_s` (load balancers that probe it stop sending), the port closes, and what is in flight
    drains (`Gateway.on_shutdown`). aiohttp's runner without its `run_app`: that closes the port first, and
    its site takes aiohttp's protocol factory, where the connection cap must sit in between."""
    app = create_app(config)
    app.on_startup.append(tune_gc)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                           keepalive_timeout=config.keepalive_timeout_s, shutdown_timeout=config.shutdown_grace_s + 5)
    stop = stop_signal()  # before start-up (health checks, the shared-state warm-up): a stop then is clean too
    await runner.setup()
    try:
        assert runner.server is not None  # set up above
        if stop.is_set():
            return
        skip_the_router_for_relays(runner)
        cap = ConnectionCap(runner.server, max_connections)
        gateway = app[GATEWAY]
        cap.export(gateway.metrics.registry)
        listener = await asyncio.get_running_loop().create_server(cap, config.host, config.port, backlog=128,
                                                                   reuse_port=reuse_port or None)
        logger.info("gateway listening on http://%s:%d: policy %s, %d backends, up to %d client connections",
                    config.host, config.port, config.routing.policy, len(config.backends), max_connections)
        await stop.wait()
        await gateway.drain.announce(config.shutdown_delay_s)
        listener.close()  # no waiting for its connections here: the runner's cleanup drains them
    finally:
        await runner.cleanup()


def stop_signal() -> asyncio.Event:
    """Set on the first SIGTERM or SIGINT. That one stops the gateway gracefully; a second one ends it at once
    (the default action is back), for whoever will not wait for the delay and the grace period."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal() -> None:
        stop.set()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal)
    return stop


def serve(config: GatewayConfig) -> int:
    if config.workers == 1:
        serve_worker(config, reuse_port=False)
        return 0
    if config.state is not None:
        return Supervisor(config).run()
    with private_store() as url:
        return Supervisor(replace(config, state=url)).run()


@contextlib.contextmanager
def private_store() -> Iterator[str]:
    """A redis-server of the workers' own on a loopback port, for --workers N without --state: workers that
    share nothing each learn only their own placements (3 instances: 45% hits on shared-prefix, against 76%
    for one; README "Several instances"). Refuses when redis-server is not installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ConfigError("--workers N needs shared state: give --state redis://HOST:PORT/DB, or install "
                          "redis-server so the workers can start a private one")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                                "--appendonly", "no", "--protected-mode", "yes"], stdout=subprocess.DEVNULL)
    try:
        _wait_for_port(port, process)
        logger.info("workers share state through a private redis-server on 127.0.0.1:%d", port)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(10)


def _wait_for_port(port: int, process: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise ConfigError(f"the private redis-server for --workers did not start on port {port}")


class Supervisor:
    """Starts `config.workers` processes on one port, replaces one that dies, and passes SIGTERM/SIGINT on."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.context = multiprocessing.get_context("spawn")  # each worker builds its own loop and state
        self.workers: list[multiprocessing.process.BaseProcess] = []
        self.stopping = False

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        self.workers = [self._start(index) for index in range(self.config.workers)]
        logger.info("started %d workers on port %d", len(self.workers), self.config.port)
        while not self.stopping:
            time.sleep(0.2)
            for index, worker in enumerate(self.workers):
                if not worker.is_alive() and not self.stopping:
                    logger.error("worker %d (pid %s) exited with %s; starting another", index, worker.pid,
                                 worker.exitcode)
                    time.sleep(_RESPAWN_PAUSE_S)
                    self.workers[index] = self._start(index)
        for worker in self.workers:
            worker.join(self.config.shutdown_delay_s + self.config.shutdown_grace_s + 10)
        return 0

    def _start(self, index: int) -> multiprocessing.process.BaseProcess:
        worker = self.context.Process(target=_worker_main, args=(self.config,),
                                      name=f"gateway-worker-{index}", daemon=False)
        worker.start()
        return worker

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        for worker in self.workers:
            if worker.is_alive():
                worker.terminate()  # SIGTERM: the worker drains as a single process would


def _worker_main(config: GatewayConfig) -> None:
    from gateway.observe.logs import configure_logging

    configure_logging(config.log_level, config.log_format)
    serve_worker(config, reuse_port=True)
