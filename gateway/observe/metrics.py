"""Prometheus metrics, all prefixed `gateway_`, in a registry of the app's own (no global state).

The fleet's actual cache-hit rate is one PromQL division:
    sum(rate(gateway_cached_tokens_total[5m])) / sum(rate(gateway_prompt_tokens_total[5m]))
and the index's accuracy another: `gateway_predicted_cached_tokens_total` over `gateway_cached_tokens_total`.
Per backend, the share of requests routed for a cached prefix that found it there (issue #20: conversations
whose histories were evicted or moved) is `gateway_prefix_turns_total{found="true"}` over all of them.
Backend state (health, in-flight, index size) is read from the pool at scrape time, never copied.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gateway.fleet.pool import Pool

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
FRACTION_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


class _PoolCollector(Collector):
    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "healthy": ("1 when the backend passes health checks", lambda b: float(b.healthy)),
            "ejected": ("1 while outlier ejection keeps the backend out of rotation or on probation",
                        lambda b: float(b.outlier.ejected)),
            "in_flight_requests": ("requests sent to the backend and not finished", lambda b: float(b.in_flight)),
            "pending_prefill_tokens": ("uncached prompt tokens reserved on the backend, not yet past first byte",
                                       lambda b: float(b.pending_prefill_tokens)),
            "prefill_tokens_per_second": ("prefill rate the backend has shown (0 until learned)",
                                          lambda b: b.backlog.tokens_per_s or 0.0),
            "index_blocks": ("blocks in the backend's prefix index", lambda b: float(b.index.size_blocks)),
            "index_capacity_blocks": ("bound of the backend's prefix index, in blocks",
                                      lambda b: float(b.index.capacity_blocks)),
        }
        for name, (help_text, read) in gauges.items():
            family = GaugeMetricFamily(f"gateway_backend_{name}", help_text, labels=["backend", "model"])
            for backend in self._pool.backends:
                family.add_metric([backend.url, backend.model or ""], read(backend))
            yield family
        ejections = CounterMetricFamily("gateway_backend_ejections", "Outlier ejections of the backend, by the "
                                        "failure that decided each", labels=["backend", "model", "cause"])
        for backend in self._pool.backends:
            for cause, count in backend.outlier.ejections_total.items():
                ejections.add_metric([backend.url, backend.model or "", cause], float(count))
        yield ejections


Child = TypeVar("Child")


class _Family(Collector, Generic[Child]):
    """A labelled metric family whose children are bound once per label set and updated without a lock: the
    gateway updates them from its event loop only. prometheus-client's children take a lock (and its histogram
    walks every bucket) on every update, a cost paid several times per request here."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str], registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.label_names = name, documentation, list(labels)
        self._children: dict[tuple[str, ...], Child] = {}
        registry.register(self)

    def new_child(self) -> Child:
        raise NotImplementedError

    def labels(self, *values: str) -> Child:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.new_child()
        return child

    def forget(self, label: str, value: str) -> None:
        """Drop the children whose `label` is `value`."""
        position = self.label_names.index(label)
        self._children = {values: child for values, child in self._children.items() if values[position] != value}


class Count:
    """One labelled counter's value."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class FastCounter(_Family[Count]):
    """A counter family with the same exposition as prometheus-client's (`NAME_total`), cheaper to count."""

    def new_child(self) -> Count:
        return Count()

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.label_names)
        for values, child in list(self._children.items()):
            family.add_metric(list(values), child.value)
        yield family


class Buckets:
    """One labelled histogram's counts. Observing is a bisect and two additions."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class FastHistogram(_Family[Buckets]):
    """A histogram family with the same exposition as prometheus-client's, cheaper to observe."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self.bounds = tuple(buckets)
        super().__init__(name, documentation, labels, registry)

    def new_child(self) -> Buckets:
        return Buckets(self.bounds)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.label_names)
        for values, child in list(self._children.items()):
            cumulative, total = [], 0
            for bound, count in zip((*map(floatToGoString, self.bounds), "+Inf"), child.counts, strict=True):
                total += count
                cumulative.append((bound, total))
            family.add_metric(list(values), cumulative, child.sum)
        yield family


class GatewayMetrics:
    def __init__(self, pool: Pool) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(pool))
        labels = ["model", "backend"]
        self.requests = FastCounter("gateway_requests", "Requests answered, by outcome",
                                    ["endpoint", "model", "backend", "route", "status"], self.registry)
        self.upstream_latency = FastHistogram("gateway_upstream_latency_seconds",
                                              "Time from forwarding a request to the end of its response",
                                              ["endpoint", "backend"], LATENCY_BUCKETS_S, self.registry)
        self.upstream_ttfb = FastHistogram("gateway_upstream_ttfb_seconds",
                                           "Time from forwarding a request to the first response byte",
                                           ["endpoint", "backend"], LATENCY_BUCKETS_S, self.registry)
        self.prefix_match = FastHistogram("gateway_prefix_match_ratio",
                                          "Share of the prompt the chosen backend was predicted to hold",
                                          ["model", "route"], FRACTION_BUCKETS, self.registry)
        self.prompt_tokens = FastCounter("gateway_prompt_tokens", "Prompt tokens as the backends report them",
                                         labels, self.registry)
        self.cached_tokens = FastCounter("gateway_cached_tokens",
                                         "Prompt tokens the backends report as served from their prefix cache",
                                         labels, self.registry)
        self.predicted_cached_tokens = FastCounter(
            "gateway_predicted_cached_tokens", "Prompt tokens the prefix index predicted cached (same requests "
            "as gateway_cached_tokens)", labels, self.registry)
        self.index_corrections = FastCounter("gateway_index_corrections",
                                             "Times a backend reported far fewer cached tokens than predicted and "
                                             "the index forgot the evicted part", ["backend"], self.registry)
        self.prefix_turns = FastCounter("gateway_prefix_turns", "Requests routed for a prompt prefix the fleet was "
                                        "predicted to hold (routes prefix and spill: a conversation's next turn, a "
                                        "question behind a cached document), by whether their backend reported it "
                                        "cached", ["model", "backend", "found"], self.registry)
        self.upstream_errors = FastCounter("gateway_upstream_errors", "Failed exchanges with a backend, by kind",
                                           ["backend", "kind"], self.registry)
        self.rewritten_spans = FastCounter("gateway_rewrite_spans", "Volatile spans found near the prompt start",
                                           ["rule", "action"], self.registry)
        self._children: dict[tuple[str, ...], tuple[Count, Buckets, Buckets, Buckets]] = {}

    def request_done(self, endpoint: str, model: str, backend: str, route: str, status: str,
                     latency_s: float | None, ttfb_s: float | None, match: float | None) -> None:
        """One finished request: its four children are looked up once per label set, with one key."""
        key = (endpoint, model, backend, route, status)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (
                self.requests.labels(*key), self.upstream_latency.labels(endpoint, backend),
                self.upstream_ttfb.labels(endpoint, backend), self.prefix_match.labels(model, route))
        requests, latency, ttfb, prefix_match = children
        requests.inc()
        if latency_s is not None:
            latency.observe(latency_s)
        if ttfb_s is not None:
            ttfb.observe(ttfb_s)
        if match is not None:
            prefix_match.observe(match)

    def token_counters(self, model: str, backend: str) -> tuple[Count, Count, Count]:
        """The prompt, cached and predicted-cached token counters of one model on one backend."""
        return (self.prompt_tokens.labels(model, backend), self.cached_tokens.labels(model, backend),
                self.predicted_cached_tokens.labels(model, backend))

    def prefix_turn(self, model: str, backend: str, found: bool) -> None:
        self.prefix_turns.labels(model, backend, "true" if found else "false").inc()

    def forget_backend(self, url: str) -> None:
        """Drop every series labelled with a removed backend's URL: a fleet whose replicas come and go (discovery)
        would otherwise export a growing set of dead series."""
        for family in (self.requests, self.prompt_tokens, self.cached_tokens, self.predicted_cached_tokens,
                       self.index_corrections, self.upstream_errors, self.prefix_turns, self.upstream_latency,
                       self.upstream_ttfb):
            family.forget("backend", url)
        self._children = {key: children for key, children in self._children.items() if key[2] != url}

    def forget_models(self, models: set[str]) -> None:
        """Drop every series labelled with a model no backend serves any more (`Pool.models_gone`): LoRA adapters
        are loaded and unloaded at run time, and each would otherwise leave its series behind for good."""
        for model in models:
            for family in (self.requests, self.prompt_tokens, self.cached_tokens, self.predicted_cached_tokens,
                           self.prefix_turns, self.prefix_match):
                family.forget("model", model)
        self._children = {key: children for key, children in self._children.items() if key[1] not in models}

    def render(self) -> bytes:
        return generate_latest(self.registry)

