"""The gateway's own cost: identical requests direct to a zero-latency replica, through the gateway, and
through sglang-router, measured side by side in one run.

The replica runs with `--time-scale 0`, so it answers as fast as its process can; whatever a front adds is
the front's cost. Two phases per path: latency at concurrency 1 (added p50/p99 over direct), then throughput
with many requests in flight (a path's requests/s over direct's). All times here are real wall-clock.
On a small machine the client, the replica and the front share the cores, so the throughput ratio is a
lower bound of what a front alone would sustain.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from loadtest.client import DriveOptions, DriveResult, drive
from loadtest.fleet import running_fleet
from loadtest.progress import Progress
from loadtest.runner import SGLANG_ROUTER, sglang_router_installed
from loadtest.scenarios import Kind, Workload
from loadtest.stats import percentile
from loadtest.workload import Conversation, generate

DIRECT = "direct"
GATEWAY = "gateway"


@dataclass(frozen=True)
class OverheadConfig:
    latency_requests: int = 200          # sent one at a time
    throughput_requests: int = 1000      # sent `concurrency` at a time
    concurrency: int = 32
    stream: bool = False
    policy: str = "prefix_aware"
    output_tokens: int = 16
    seed: int = 0
    peer: bool = True                    # include sglang-router when installed


@dataclass(frozen=True)
class PathResult:
    label: str
    p50_ms: float
    p99_ms: float
    requests_per_s: float
    errors: int


def overhead_workload(config: OverheadConfig, count: int) -> tuple[Conversation, ...]:
    """Small chat requests sharing 8 system prompts: the front does its full routing work on each."""
    return generate(Workload(kind=Kind.SHARED_PREFIX, groups=8, prompts_per_group=1, system_tokens=512,
                             question_tokens=64, output_tokens=config.output_tokens, num_prompts=count,
                             seed=config.seed))


def measure(url: str, label: str, config: OverheadConfig) -> PathResult:
    latency = _phase(url, f"{label} latency", overhead_workload(config, config.latency_requests), 1, config)
    throughput = _phase(url, f"{label} throughput", overhead_workload(config, config.throughput_requests),
                        config.concurrency, config)
    e2e_ms = [r.e2e_s * 1000 for r in latency.results if r.error is None]
    ok = sum(r.error is None for r in throughput.results)
    errors = sum(r.error is not None for r in (*latency.results, *throughput.results))
    return PathResult(label, percentile(e2e_ms, 50), percentile(e2e_ms, 99), ok / throughput.duration_s, errors)


def _phase(url: str, label: str, conversations: tuple[Conversation, ...], concurrency: int,
           config: OverheadConfig) -> DriveResult:
    progress = Progress(len(conversations), label)
    options = DriveOptions(max_concurrency=concurrency, stream=config.stream, seed=config.seed)
    result = asyncio.run(drive(url, conversations, options,
                               on_done=lambda r: progress.advance(error=r.error is not None)))
    progress.close()
    return result


def run_overhead(config: OverheadConfig) -> list[PathResult]:
    with running_fleet() as fleet:
        replica = fleet.start_replicas(1, args=["--model", "sim-llm", "--time-scale", "0"])
        # Warm up each path once so connection set-up and first-request costs stay out of the numbers.
        paths = [(DIRECT, replica.url)]
        paths.append((f"{GATEWAY} ({config.policy})",
                      fleet.start_gateway(replica.urls, args=["--policy", config.policy]).url))
        if config.peer and sglang_router_installed():
            paths.append((f"{SGLANG_ROUTER} (cache_aware)", fleet.start_sglang_router(replica.urls).url))
        warm = OverheadConfig(latency_requests=5, throughput_requests=config.concurrency,
                              concurrency=config.concurrency, stream=config.stream, seed=config.seed + 1)
        for label, url in paths:
            measure(url, label, warm)
        return [measure(url, label, config) for label, url in paths]


OVERHEAD_COLUMNS = ("path", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms", "max req/s", "vs direct", "errors")


def overhead_rows(results: Sequence[PathResult]) -> list[list[str]]:
    direct = results[0]
    return [[r.label, f"{r.p50_ms:.2f}", f"{r.p99_ms:.2f}",
             "-" if r is direct else f"{r.p50_ms - direct.p50_ms:+.2f}",
             "-" if r is direct else f"{r.p99_ms - direct.p99_ms:+.2f}",
             f"{r.requests_per_s:.0f}", f"{r.requests_per_s / direct.requests_per_s:.2f}x", str(r.errors)]
            for r in results]
