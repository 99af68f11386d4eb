"""From per-request results to one run's summary: latency percentiles, throughput, goodput, hit rates.

Every time is converted from wall-clock to simulated seconds by dividing by the fleet's `time_scale` (1.0
against a real deployment), so latencies, rates and SLOs all read in the units of the modelled hardware.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from loadtest.client import DriveResult, RequestResult
from loadtest.scenarios import Slo
from loadtest.workload import RequestKind


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float
    mean: float


@dataclass(frozen=True)
class RunSummary:
    label: str                  # the policy, or the peer's name
    requests: int
    errors: int
    duration_s: float
    ttft_s: Percentiles
    itl_s: Percentiles
    tpot_s: Percentiles
    e2e_s: Percentiles
    requests_per_s: float
    output_tokens_per_s: float
    goodput_per_s: float        # requests/s meeting both the TTFT and the TPOT SLO
    slo_attainment: float       # share of requests meeting both
    hit_rate: float             # sum(cached) / sum(prompt) tokens over chat responses
    oracle_hit_rate: float | None
    replica_max_over_mean: float
    requests_per_replica: dict[str, int]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentiles(values: Sequence[float]) -> Percentiles:
    mean = sum(values) / len(values) if values else math.nan
    return Percentiles(percentile(values, 50), percentile(values, 90), percentile(values, 99), mean)


def tpot_s(result: RequestResult) -> float | None:
    """Time per output token after the first, the way SGLang's bench defines it."""
    if result.ttft_s is None or result.output_tokens <= 1:
        return 0.0 if result.ttft_s is not None else None
    return (result.e2e_s - result.ttft_s) / (result.output_tokens - 1)


def meets_slo(result: RequestResult, slo: Slo, time_scale: float) -> bool:
    if result.error is not None or result.ttft_s is None:
        return False
    per_token = tpot_s(result) or 0.0
    return result.ttft_s / time_scale <= slo.ttft_s and per_token / time_scale <= slo.tpot_s


def replica_balance(results: Sequence[RequestResult]) -> tuple[float, dict[str, int]]:
    """max/mean of requests per replica (1.0 = perfectly even) and the counts, from `x-replica-id`."""
    counts = Counter(result.replica for result in results if result.replica and result.error is None)
    if not counts:
        return math.nan, {}
    mean = sum(counts.values()) / len(counts)
    return max(counts.values()) / mean, dict(sorted(counts.items()))


def summarise(label: str, drive: DriveResult, *, time_scale: float, slo: Slo, oracle_hit_rate: float | None,
              replica_counts: dict[str, int] | None = None) -> RunSummary:
    """`replica_counts` (from the replicas' metrics) replaces the header count when a proxy drops headers."""
    results = drive.results
    ok = [result for result in results if result.error is None]
    chats = [result for result in ok if result.kind is RequestKind.CHAT]
    scale = 1.0 / time_scale
    duration = drive.duration_s * scale
    prompt = sum(result.prompt_tokens for result in chats)
    balance, counts = replica_balance(chats)
    if replica_counts:
        counts = dict(sorted(replica_counts.items()))
        balance = max(counts.values()) / (sum(counts.values()) / len(counts))
    good = sum(meets_slo(result, slo, time_scale) for result in results)
    return RunSummary(
        label=label,
        requests=len(results),
        errors=len(results) - len(ok),
        duration_s=duration,
        ttft_s=percentiles([r.ttft_s * scale for r in ok if r.ttft_s is not None]),
        itl_s=percentiles([gap * scale for r in chats for gap in r.itl_s]),
        tpot_s=percentiles([t * scale for r in chats if r.output_tokens > 1 and (t := tpot_s(r)) is not None]),
        e2e_s=percentiles([r.e2e_s * scale for r in ok]),
        requests_per_s=len(ok) / duration if duration else 0.0,
        output_tokens_per_s=sum(r.output_tokens for r in ok) / duration if duration else 0.0,
        goodput_per_s=good / duration if duration else 0.0,
        slo_attainment=good / len(results) if results else 0.0,
        hit_rate=sum(r.cached_tokens for r in chats) / prompt if prompt else 0.0,
        oracle_hit_rate=oracle_hit_rate,
        replica_max_over_mean=balance,
        requests_per_replica=counts,
    )
