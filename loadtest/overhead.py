"""What a front costs, measured side by side in one run (issue #24): direct to a zero-cost backend, through
sglang-router and smg (round_robin), and through the gateway with round_robin and prefix_aware.

The load comes from wrk (C) and the non-streamed answers from nginx, so neither the client nor the backend is
what limits a front: a Python client or replica would be. Per front: requests/s at 16 and 64 connections,
latency at 1 connection (and what the front adds over direct), the front's CPU time per request (its process
tree's utime + stime over the measured window, divided by the requests completed: stable on a shared machine
where requests/s is not), its resident memory after the warm-up and after the last round, what each idle client
connection adds to it (`IDLE_CONNECTIONS` opened after the rounds, each after one request), and streaming: SSE
chunks relayed per second over 64 concurrent streams paced like an engine (`loadtest/sse_backend.py`), plus one
stream read through the front to check that it relays chunk by chunk.

The fronts are interleaved (A B C, A B C, ...), each point after a short warm-up at its own concurrency, and
every figure is the median over the rounds.
"""

from __future__ import annotations

import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.fronts import DEFAULT_FRONTS, Front, StreamReads, idle_connections, start_front, stream_reads
from loadtest.nginx import start_nginx
from loadtest.procstat import machine_busy_s, usage
from loadtest.wrk import chat_bodies, lua_script, run_wrk
from simulator.fleet import Fleet, FleetError, Process, base_url, free_port, running_fleet, start_process

C1, C16, C64, STREAM = "c1", "c16", "c64", "stream"
CONNECTIONS = {C1: 1, C16: 16, C64: 64}
STREAMS = 64                 # concurrent streams of the streaming phase
CHUNK_INTERVAL_MS = 2.0      # one chunk per stream every 2 ms, as an engine decoding at 500 tokens/s
IDLE_CONNECTIONS = 256       # for memory per connection: 4x the 64 the rounds opened, so most are new ones


@dataclass(frozen=True)
class OverheadConfig:
    rounds: int = 3
    duration_s: int = 10           # measured seconds of each point (wrk takes whole seconds)
    fronts: tuple[str, ...] = DEFAULT_FRONTS
    stream_chunks: int = 64        # SSE chunks per streamed answer

    @property
    def warmup_s(self) -> int:
        """Before each point, at its own concurrency: fills the front's pools without stretching the run."""
        return min(2, max(1, self.duration_s // 5))


@dataclass(frozen=True)
class Point:
    """One wrk run against one front (or the median of several). For streams, a request is a whole stream."""

    ok_per_s: float
    p50_ms: float
    p99_ms: float
    cpu_us_per_request: float | None   # None for direct: no front process
    errors: int
    other_cores: float | None = None   # CPU other programs took meanwhile, in cores: high means a disturbed point


@dataclass
class FrontResult:
    name: str
    points: dict[str, Point] = field(default_factory=dict)   # C1, C16, C64, STREAM: medians over the rounds
    rss_start_mb: float | None = None                         # after the first warm-up
    rss_end_mb: float | None = None                           # after the last non-streaming round
    stream_reads: StreamReads | None = None
    kib_per_connection: float | None = None                   # resident memory an idle client connection adds


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def median_point(points: Sequence[Point]) -> Point:
    return Point(ok_per_s=statistics.median(p.ok_per_s for p in points),
                 p50_ms=statistics.median(p.p50_ms for p in points),
                 p99_ms=statistics.median(p.p99_ms for p in points),
                 cpu_us_per_request=_median([p.cpu_us_per_request for p in points]),
                 errors=sum(p.errors for p in points),
                 other_cores=_median([p.other_cores for p in points]))


@dataclass(frozen=True)
class CpuClock:
    """CPU seconds so far: the front's process tree, the backend's, ours with wrk's, and the whole machine's."""

    front_s: float
    backend_s: float
    ours_s: float
    machine_s: float

    @classmethod
    def read(cls, front_pid: int | None, backend_pid: int) -> CpuClock:
        # wrk is a child we wait for, so its CPU shows in RUSAGE_CHILDREN; the fronts and the backend are not
        # waited for until they stop, so nothing is counted twice.
        ours = sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
                   for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        return cls(front_s=usage(front_pid).cpu_s if front_pid is not None else 0.0,
                   backend_s=usage(backend_pid).cpu_s, ours_s=ours, machine_s=machine_busy_s())

    def other_s(self, later: CpuClock) -> float:
        """CPU seconds other programs spent between this reading and `later`."""
        return (later.machine_s - self.machine_s) - (later.front_s - self.front_s) \
            - (later.backend_s - self.backend_s) - (later.ours_s - self.ours_s)


def measure(front: Front, backend_pid: int, script: Path, connections: int, config: OverheadConfig) -> Point:
    """A warm-up, then `duration_s` seconds of wrk with the CPU clocks read before and after."""
    run_wrk(front.url, script, connections, config.warmup_s)
    before = CpuClock.read(front.pid, backend_pid)
    result = run_wrk(front.url, script, connections, config.duration_s)
    after = CpuClock.read(front.pid, backend_pid)
    cpu_us = None
    if front.pid is not None and result.ok:
        cpu_us = (after.front_s - before.front_s) * 1e6 / result.ok
    other_cores = max(0.0, before.other_s(after)) / result.duration_s if result.duration_s > 0 else None
    return Point(result.ok_per_s, result.p50_ms, result.p99_ms, cpu_us, result.errors, other_cores)


def rss_mb(front: Front) -> float | None:
    return None if front.pid is None else usage(front.pid).rss_bytes / 2**20


def kib_per_connection(front: Front, probe: str) -> float | None:
    """What each idle keep-alive client connection adds to the front's resident memory, in KiB."""
    if front.pid is None:
        return None
    before = usage(front.pid).rss_bytes
    with idle_connections(front.url, probe, IDLE_CONNECTIONS):
        time.sleep(0.5)  # a front that hands connections to workers has settled them
        after = usage(front.pid).rss_bytes
    return (after - before) / IDLE_CONNECTIONS / 1024


def write_script(directory: Path, stream: bool) -> Path:
    path = directory / ("stream.lua" if stream else "chat.lua")
    path.write_text(lua_script(chat_bodies(stream=stream)), encoding="utf-8")
    return path


def log_point(round_index: int, config: OverheadConfig, front: str, label: str, point: Point) -> None:
    cpu = "-" if point.cpu_us_per_request is None else f"{point.cpu_us_per_request:,.0f}"
    other = "-" if point.other_cores is None else f"{point.other_cores:.2f}"
    print(f"round {round_index + 1}/{config.rounds} {front} {label}: {point.ok_per_s:,.0f}/s, "
          f"p50 {point.p50_ms:.2f} ms, p99 {point.p99_ms:.2f} ms, CPU {cpu} us each, {point.errors} errors, "
          f"other programs {other} cores", file=sys.stderr)


def non_streaming_phase(fronts: Sequence[Front], backend_pid: int, script: Path, probe: str, config: OverheadConfig,
                        results: dict[str, FrontResult]) -> None:
    for front in fronts:
        run_wrk(front.url, script, CONNECTIONS[C64], config.warmup_s)
        results[front.name].rss_start_mb = rss_mb(front)
    samples: dict[tuple[str, str], list[Point]] = {}
    for round_index in range(config.rounds):
        for front in fronts:
            for label, connections in CONNECTIONS.items():
                point = measure(front, backend_pid, script, connections, config)
                log_point(round_index, config, front.name, label, point)
                samples.setdefault((front.name, label), []).append(point)
    for front in fronts:
        results[front.name].rss_end_mb = rss_mb(front)
        results[front.name].kib_per_connection = kib_per_connection(front, probe)
        for label in CONNECTIONS:
            results[front.name].points[label] = median_point(samples[(front.name, label)])


def streaming_phase(fronts: Sequence[Front], backend_pid: int, script: Path, probe: str, config: OverheadConfig,
                    results: dict[str, FrontResult]) -> None:
    for front in fronts:
        results[front.name].stream_reads = stream_reads(front.url, probe)
    samples: dict[str, list[Point]] = {}
    for round_index in range(config.rounds):
        for front in fronts:
            point = measure(front, backend_pid, script, STREAMS, config)
            log_point(round_index, config, front.name, STREAM, point)
            samples.setdefault(front.name, []).append(point)
    for front in fronts:
        results[front.name].points[STREAM] = median_point(samples[front.name])


def start_sse_backend(fleet: Fleet, config: OverheadConfig) -> Process:
    port = free_port()
    argv = [sys.executable, "-m", "loadtest.sse_backend", "--port", str(port),
            "--chunks", str(config.stream_chunks), "--interval-ms", str(CHUNK_INTERVAL_MS)]
    process = start_process("sse-backend", argv, [base_url(port)], ready_path="/health")
    fleet.processes.append(process)
    return process


def start_fronts(fleet: Fleet, names: Sequence[str], backend: str, probe: str) -> list[Front]:
    """The fronts that start; one that does not is left out with its error, so one broken front (an optional
    one, most likely) does not cost the whole run. Its row stays empty."""
    fronts = []
    for name in names:
        try:
            fronts.append(start_front(fleet, name, backend, probe))
        except FleetError as exc:
            print(f"{name} left out: it did not start: {exc}", file=sys.stderr)
    return fronts


def run_overhead(config: OverheadConfig) -> list[FrontResult]:
    """Both phases over `config.fronts`; each phase starts its backend and a fresh set of fronts before it."""
    results = {name: FrontResult(name) for name in config.fronts}
    with tempfile.TemporaryDirectory(prefix="overhead-") as temp:
        directory = Path(temp)
        with running_fleet() as fleet:
            nginx = start_nginx(directory / "nginx")
            fleet.processes.append(nginx)
            probe = chat_bodies(stream=False, count=1)[0]
            fronts = start_fronts(fleet, config.fronts, nginx.url, probe)
            non_streaming_phase(fronts, nginx.popen.pid, write_script(directory, stream=False), probe, config,
                                results)
        with running_fleet() as fleet:
            backend = start_sse_backend(fleet, config)
            probe = chat_bodies(stream=True, count=1)[0]
            fronts = start_fronts(fleet, config.fronts, backend.url, probe)
            streaming_phase(fronts, backend.popen.pid, write_script(directory, stream=True), probe, config,
                            results)
    return [results[name] for name in config.fronts]
