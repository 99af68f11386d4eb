"""What sharing state cost in a run of several gateway instances: updates and bytes per routed request, the
store's traffic, and the delay from an update's publication to its application on another instance."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import httpx2
import redis
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class SharingFigures:
    requests: int
    published_updates: float
    published_bytes: float  # the updates themselves, packed
    store_bytes: int  # everything the store received and sent (entries, load, reads, protocol)
    store_commands: int
    delay_count: float
    delay_sum_s: float
    delay_buckets: dict[float, float]  # upper bound in s -> applications within it, over all instances

    def delay_quantile_s(self, q: float) -> float:
        """Upper bound of the histogram bucket holding quantile `q` of the publish-to-apply delays."""
        wanted = q * self.delay_count
        return next((bound for bound, count in sorted(self.delay_buckets.items()) if count >= wanted),
                    float("inf"))

    def describe(self) -> str:
        per = max(1, self.requests)
        mean_ms = 1000 * self.delay_sum_s / self.delay_count if self.delay_count else float("nan")
        return (f"shared state: {self.published_updates / per:.2f} updates and {self.published_bytes / per:.0f} "
                f"bytes published per routed request; store traffic {self.store_bytes / per:.0f} bytes and "
                f"{self.store_commands / per:.1f} commands per request; publish-to-apply delay mean "
                f"{mean_ms:.0f} ms, p50 <= {1000 * self.delay_quantile_s(0.5):.0f} ms, "
                f"p99 <= {1000 * self.delay_quantile_s(0.99):.0f} ms")


def sharing_figures(gateways: Sequence[str], store_url: str, requests: int) -> SharingFigures:
    totals: dict[str, float] = {}
    buckets: dict[float, float] = {}
    with httpx2.Client(trust_env=False, timeout=10.0) as client:
        for gateway in gateways:
            for family in text_string_to_metric_families(client.get(gateway + "/metrics").text):
                for sample in family.samples:
                    if sample.name == "gateway_state_apply_delay_seconds_bucket":
                        bound = float(sample.labels["le"])
                        buckets[bound] = buckets.get(bound, 0.0) + sample.value
                    elif sample.name.startswith("gateway_state_"):
                        totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    store = redis.Redis.from_url(store_url)
    try:
        stats = store.info("stats")
    finally:
        store.close()
    return SharingFigures(requests, totals.get("gateway_state_published_updates_total", 0.0),
                          totals.get("gateway_state_published_bytes_total", 0.0),
                          int(stats["total_net_input_bytes"]) + int(stats["total_net_output_bytes"]),
                          int(stats["total_commands_processed"]),
                          totals.get("gateway_state_apply_delay_seconds_count", 0.0),
                          totals.get("gateway_state_apply_delay_seconds_sum", 0.0), buckets)
