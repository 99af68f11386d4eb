"""The live page at `/dashboard` and the JSON it polls, `/dashboard/data`.

The page (`gateway/observe/static/dashboard.html`, one file with inline CSS and JS, no build step, nothing fetched from
elsewhere) asks for `/dashboard/data` every second. Each answer is a snapshot of the pool (`Backend.describe()`)
plus a short history: every poll at least `SAMPLE_INTERVAL_S` after the last one records a sample of each
backend's gauges and cumulative counters in a ring buffer bounded by `HISTORY_S`. Sampling on poll needs no
background task: the history covers the time the page was open (in any browser), and a gap while nobody looked
shows as a gap. Rates, hit rates and the route mix are differences between samples over the last `WINDOW_S`, not
over the gateway's whole life.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from aiohttp import web

from gateway.errors import BadRequest
from gateway.fleet.pool import Pool
from gateway.observe.metrics import FastCounter, GatewayMetrics

SAMPLE_INTERVAL_S = 0.9  # a little under the page's 1 s poll, so a late poll still samples
HISTORY_S = 300.0  # what the charts show: "the last minutes"
WINDOW_S = 60.0  # what the rates, hit rates and route mix are computed over: recent, yet not noisy
MAX_SAMPLES = int(HISTORY_S / SAMPLE_INTERVAL_S) + 1
# What each sample counts per backend: name on the page -> GatewayMetrics attribute (a counter with a backend label).
COUNTERS = {"requests": "requests", "errors": "upstream_errors", "prompt_tokens": "prompt_tokens",
            "cached_tokens": "cached_tokens", "predicted_cached_tokens": "predicted_cached_tokens"}


@dataclass(frozen=True)
class Sample:
    """The fleet at one moment. Gauges are per backend URL; counters are cumulative since the gateway started."""

    at_s: float  # wall-clock (time.time()), for the page's time axis
    gauges: dict[str, dict[str, Any]]  # url -> healthy, in_flight, queued_prefill_tokens, kv_usage
    counters: dict[str, dict[str, float]]  # url -> requests, errors, prompt/cached/predicted_cached tokens
    routes: dict[str, float]  # route -> requests


def counter_totals(counter: FastCounter, by: Iterable[str]) -> dict[tuple[str, ...], float]:
    """A labelled counter's values summed over every label not in `by`."""
    keys = tuple(by)
    totals: dict[tuple[str, ...], float] = collections.defaultdict(float)
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                totals[tuple(sample.labels[key] for key in keys)] += sample.value
    return dict(totals)


def take_sample(pool: Pool, metrics: GatewayMetrics, at_s: float) -> Sample:
    counters = {name: counter_totals(getattr(metrics, attribute), ["backend"])
                for name, attribute in COUNTERS.items()}
    gauges, per_backend = {}, {}
    for backend in pool.backends:
        described = backend.describe()
        gauges[backend.url] = {name: described[name] for name in ("healthy", "in_flight", "queued_prefill_tokens")}
        gauges[backend.url]["kv_usage"] = described["signals"] and described["signals"]["kv_usage"]
        per_backend[backend.url] = {name: values.get((backend.url,), 0.0) for name, values in counters.items()}
    routes = {route: value for (route,), value in counter_totals(metrics.requests, ["route"]).items()}
    return Sample(at_s, gauges, per_backend, routes)


def ratio(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def rates(delta: Mapping[str, float], elapsed_s: float) -> dict[str, Any]:
    return {"requests": delta["requests"], "requests_per_s": delta["requests"] / elapsed_s,
            "errors": delta["errors"],
            "predicted_hit_rate": ratio(delta["predicted_cached_tokens"], delta["prompt_tokens"]),
            "reported_hit_rate": ratio(delta["cached_tokens"], delta["prompt_tokens"])}


def window_stats(first: Sample, last: Sample) -> dict[str, Any]:
    """What happened between two samples: per backend and fleet-wide rates and hit rates, and the route mix."""
    elapsed_s = max(last.at_s - first.at_s, 1e-9)
    deltas = {url: {name: value - first.counters.get(url, {}).get(name, 0.0) for name, value in now.items()}
              for url, now in last.counters.items()}
    fleet_delta = {name: sum(delta[name] for delta in deltas.values()) for name in COUNTERS}
    routes = {route: value - first.routes.get(route, 0.0) for route, value in last.routes.items()}
    return {"seconds": last.at_s - first.at_s, "fleet": rates(fleet_delta, elapsed_s),
            "backends": {url: rates(delta, elapsed_s) for url, delta in deltas.items()},
            "routes": {route: count for route, count in sorted(routes.items()) if count > 0}}


def series_point(previous: Sample | None, sample: Sample) -> dict[str, Any]:
    """One point of the page's charts: the gauges, and the request rate since the previous sample."""
    backends = {}
    for url, gauges in sample.gauges.items():
        rate = None
        if previous is not None and url in previous.counters:
            elapsed_s = max(sample.at_s - previous.at_s, 1e-9)
            rate = (sample.counters[url]["requests"] - previous.counters[url]["requests"]) / elapsed_s
        backends[url] = {**gauges, "requests_per_s": rate}
    return {"t": sample.at_s, "backends": backends}


class Dashboard:
    """The two routes, the page's HTML (read once) and the sample history."""

    def __init__(self, pool: Pool, metrics: GatewayMetrics, policy: str) -> None:
        self.pool = pool
        self.metrics = metrics
        self.policy = policy
        self.samples: collections.deque[Sample] = collections.deque(maxlen=MAX_SAMPLES)
        self.html = resources.files("gateway.observe").joinpath("static/dashboard.html").read_text(encoding="utf-8")

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/dashboard", self.page), web.get("/dashboard/data", self.data)]

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(text=self.html, content_type="text/html", headers={"cache-control": "no-store"})

    async def data(self, request: web.Request) -> web.Response:
        """`?since=T` (a sample time the page already has) sends only the newer chart points."""
        try:
            since_s = float(request.query.get("since", "0"))
        except ValueError:
            raise BadRequest("since must be a number (seconds since the epoch).", param="since") from None
        return web.json_response(self.snapshot(time.time(), since_s), headers={"cache-control": "no-store"})

    def sample(self, now_s: float) -> None:
        """Record a sample unless the last one is recent; forget those older than the history."""
        if self.samples and now_s - self.samples[-1].at_s < SAMPLE_INTERVAL_S:
            return
        self.samples.append(take_sample(self.pool, self.metrics, now_s))
        while now_s - self.samples[0].at_s > HISTORY_S:
            self.samples.popleft()

    def snapshot(self, now_s: float, since_s: float = 0.0) -> dict[str, Any]:
        self.sample(now_s)
        samples = list(self.samples)
        previous: list[Sample | None] = [None, *samples[:-1]]
        points = [(before, sample) for before, sample in zip(previous, samples, strict=True) if sample.at_s > since_s]
        window_start = next(sample for sample in samples if sample.at_s >= samples[-1].at_s - WINDOW_S)
        return {
            "now_s": now_s, "policy": self.policy, "history_s": HISTORY_S,
            "backends": [backend.describe() for backend in self.pool.backends],
            "window": window_stats(window_start, samples[-1]),
            "series": [series_point(before, sample) for before, sample in points],
        }

