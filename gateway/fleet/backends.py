"""The backends (engine replicas) behind the gateway: what each serves, whether it is healthy, how loaded it is.

A `Backend` is mutable state owned by the event loop and changed only through its own methods: the health checker
reports checks, discoveries and load readings; the router reserves and releases load; the record step reports how
each exchange ended (outlier ejection, outlier.py); policies only read. The pool of them is pool.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.fleet.engines import Engine, EngineInfo, ModelInfo
from gateway.fleet.outlier import FAILED_STATUSES, Ejection, Outlier
from gateway.fleet.upstream import Failure
from gateway.routing.active_blocks import ActiveBlocks
from gateway.routing.backlog import PendingPrefill, PrefillBacklog
from gateway.routing.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendSpec:
    """A backend as configured: its URL, and optionally what it serves when discovery should not decide."""

    url: str
    model: str | None = None
    capacity_tokens: int | None = None
    name: str = ""  # what clients are told (x-gateway-backend); the URL stays internal
    api_key: str | None = None  # sent as Authorization: Bearer to this backend (vLLM's --api-key)


@dataclass(frozen=True)
class LoadSignals:
    """What the backend itself reports about its load (scraped from `/metrics`), with the time it was read."""

    queued_requests: float
    running_requests: float
    kv_usage: float  # 0..1, share of the KV pool in use
    read_at_s: float  # time.monotonic() of the scrape
    # Our requests then still waiting for their first byte: the part of the queue we know of. Compared with
    # the count at scrape time, not now, or a request of ours finished since would look like foreign work.
    ours_prefilling: int = 0


# Failures that eject at once: a refused connection, or a whole timeout waited out. A connection broken before
# the answer is not among them: a pooled keep-alive connection the engine just closed breaks that way too.
_AT_ONCE = frozenset({Failure.CONNECT, Failure.FIRST_BYTE_TIMEOUT, Failure.IDLE_TIMEOUT})
# Seconds by which a reported process start time may wander without meaning a restart (it is a float computed from
# the boot time and clock ticks, and a reporting process may round it).
RESTART_TOLERANCE_S = 1.0


@dataclass(frozen=True)
class RemoteLoad:
    """A backend's load from the other gateway instances sharing state with this one (`shared_state.py`), summed
    over them; all zero when nothing is shared, so the policies' view is then this instance's alone."""

    in_flight: int = 0
    prefilling: int = 0  # requests without a first byte yet
    prefill_tokens: int = 0  # their remaining uncached prompt tokens
    active_blocks: int = 0

    def __add__(self, other: RemoteLoad) -> RemoteLoad:
        return RemoteLoad(self.in_flight + other.in_flight, self.prefilling + other.prefilling,
                          self.prefill_tokens + other.prefill_tokens, self.active_blocks + other.active_blocks)


class Publisher(Protocol):
    """Where a backend's index changes and health verdicts go for the other gateway instances (`shared_state.py`).
    Every call only appends to a local queue: it never waits and never fails."""

    def placed(self, backend: Backend, hashes: Sequence[int]) -> None: ...

    def corrected(self, backend: Backend, hashes: Sequence[int], keep_blocks: int) -> None: ...

    def marked_down(self, backend: Backend) -> None: ...

    def cleared(self, backend: Backend) -> None: ...

    def session_visited(self, backend: Backend, key: int, blocks: int, last_hash: int) -> None: ...


class NotShared:
    """The publisher of a gateway that shares nothing."""

    def placed(self, backend: Backend, hashes: Sequence[int]) -> None:
        pass

    def corrected(self, backend: Backend, hashes: Sequence[int], keep_blocks: int) -> None:
        pass

    def marked_down(self, backend: Backend) -> None:
        pass

    def cleared(self, backend: Backend) -> None:
        pass

    def session_visited(self, backend: Backend, key: int, blocks: int, last_hash: int) -> None:
        pass


NOT_SHARED = NotShared()
NO_REMOTE_LOAD = RemoteLoad()


@dataclass(eq=False)
class Backend:
    spec: BackendSpec
    index: PrefixIndex
    model: str | None = None
    model_card: dict[str, Any] = field(default_factory=dict)  # the backend's own /v1/models entry
    # The other models it serves, by id -> its /v1/models entry: LoRA adapters of `model`, other names of it
    other_models: dict[str, dict[str, Any]] = field(default_factory=dict)
    engine: Engine | None = None  # None until discovered
    embedding: bool | None = None  # serves an embedding model; None: its engine does not say
    healthy: bool = False
    draining: bool = False  # chosen for nothing new; leaves the pool when its requests in flight are done
    removed: bool = False  # left the pool (`Pool.remove`): no health check or scrape may bring it back
    source: str = "config"  # who added it: "config", "admin", "dns:HOST:PORT" or "file:PATH" (discovery.py)
    started_at_s: float | None = None  # the engine process's start time, as its /metrics reports it
    refused_checks: bool = False  # a health check found nothing listening since the last good one
    failed_checks: int = 0  # health checks failed in a row
    passed_checks: int = 0  # ...and passed in a row
    capacity_tokens: int | None = None
    in_flight: int = 0
    signals: LoadSignals | None = None
    outlier: Outlier = field(default_factory=Outlier, repr=False)
    backlog: PrefillBacklog = field(default_factory=PrefillBacklog, repr=False)  # ours, before first byte
    _active: ActiveBlocks = field(default_factory=ActiveBlocks, repr=False)  # ours in flight, by prompt block
    remote: RemoteLoad = NO_REMOTE_LOAD  # the other instances' share, with shared state
    publisher: Publisher = field(default=NOT_SHARED, repr=False)

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def name(self) -> str:
        return self.spec.name or self.spec.url

    @property
    def fleet_in_flight(self) -> int:
        """Requests in flight on the backend from this instance and the others sharing state with it: the
        policies' view of its load."""
        return self.in_flight + self.remote.in_flight

    @property
    def active_blocks(self) -> int:
        """Distinct prompt blocks of the requests in flight: the KV memory they pin on the engine. A prefix shared
        by many running requests counts once, as it does in the engine's pool."""
        return self._active.count

    @property
    def prefilling(self) -> int:
        """Requests sent that have not produced a first byte yet."""
        return self.backlog.requests

    @property
    def pending_prefill_tokens(self) -> int:
        """Their reserved uncached prompt tokens."""
        return self.backlog.reserved_tokens

    # -- requests (the router and the record step) -----------------------------------------------------

    def reserve(self, prefill_tokens: int, hashes: Sequence[int]) -> PendingPrefill:
        self.in_flight += 1
        self._active.add(hashes)
        return self.backlog.add(prefill_tokens, time.monotonic())

    def prefill_done(self, pending: PendingPrefill) -> None:
        self.backlog.finish(pending, time.monotonic())

    def prefill_dropped(self, pending: PendingPrefill) -> None:
        self.backlog.drop(pending, time.monotonic())

    def release(self, hashes: Sequence[int]) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        self._active.release(hashes)

    def answer_started(self) -> None:
        """A good answer began: as good as a success for ejection."""
        if self.outlier.succeeded():
            logger.info("backend %s returns to service: a request succeeded after its ejection", self.url)

    def exchange_answered(self, status: int) -> None:
        """A request got a complete answer from this backend. 500, 502, 503 and 504 count against it; any other
        5xx and every 4xx are the client's business and count neither way."""
        if status in FAILED_STATUSES:
            self._failed("5xx", f"answered {status}", at_once=False)
        elif status < 400:
            self.answer_started()

    def exchange_failed(self, failure: Failure, detail: str) -> None:
        """An exchange failed in a way that is this backend's fault (never `Failure.LOCAL`: the gateway's own)."""
        if not failure.backend_fault:  # the gateway's own resources ran out: never the backend's fault
            return
        self._failed(failure.value, detail, at_once=failure in _AT_ONCE)

    def _failed(self, cause: str, detail: str, at_once: bool) -> None:
        ejection = self.outlier.failed(cause, at_once)
        if ejection is not None:
            self._log_ejection(ejection, detail)

    def _log_ejection(self, ejection: Ejection, detail: str) -> None:
        logger.warning("backend %s ejected for %.0f s after %d failure(s) in a row (last: %s)", self.url,
                       ejection.duration_s, ejection.failures, detail)

    # -- health checks and discovery (health.py) --------------------------------------------------------

    def health_check_passed(self, success_threshold: int) -> None:
        """`success_threshold` passed checks in a row bring the backend back; one ends an ejection for refused
        connections (it listens again). A backend that refused a check and listens again restarted, when its
        engine reports no start time to tell (SGLang, llama.cpp's server)."""
        if self.refused_checks and self.started_at_s is None and self.index.size_blocks:
            self.restarted("it refused a health check and answers again")
        self.refused_checks = False
        self.failed_checks = 0
        self.passed_checks += 1
        if not self.healthy and self.passed_checks >= success_threshold:
            self._mark_up()
        elif self.outlier.listening():
            logger.info("backend %s returns to service: it accepts connections again", self.url)

    def health_check_failed(self, reason: str, failure_threshold: int, refused: bool = False) -> None:
        """`failure_threshold` failed checks in a row take the backend out and forget its cache: an engine that
        stayed away that long has most likely restarted empty. `refused`: nothing listened at its address."""
        self.refused_checks = self.refused_checks or refused
        self.passed_checks = 0
        self.failed_checks += 1
        if self.healthy and self.failed_checks >= failure_threshold:
            self._mark_down(reason)
        elif not self.healthy and self.failed_checks == 1:
            logger.warning("backend %s is not healthy: %s", self.url, reason)

    def serves(self, model: str) -> bool:
        return self.model == model or model in self.other_models

    def discovered_model(self, found: ModelInfo | None) -> bool:
        """What the backend's /v1/models said (None: nothing readable); returns whether what it serves changed.
        A model pinned in config is kept; a changed model means another engine behind the URL: its cache and
        engine are forgotten. Adapters come and go with the listing (vLLM and SGLang load them at run time)."""
        before = (self.model, self.other_models.keys())
        if self.spec.model is None and found is not None and found.model != self.model:
            if self.model is not None:
                logger.warning("backend %s now serves %s (was %s)", self.url, found.model, self.model)
                self.index.clear()
            self.model = found.model
            self.engine = None  # a new model may be a new engine: look again
        if found is not None:
            self.model_card = found.card if found.model == self.model else {}
            self._discovered_others(found)
        return before != (self.model, self.other_models.keys())

    def _discovered_others(self, found: ModelInfo) -> None:
        others = {name: card for name, card in found.others.items() if name != self.model}
        if others.keys() != self.other_models.keys():
            logger.info("backend %s serves %s besides %s", self.url, ", ".join(sorted(others)) or "nothing",
                        self.model)
        self.other_models = others

    def discovered_engine(self, found: EngineInfo, index_capacity_blocks: Callable[[int | None], int]) -> None:
        """The engine and its KV capacity (a configured capacity wins); the prefix index is bounded to match."""
        self.engine = found.engine
        self.embedding = found.embedding
        self.capacity_tokens = self.spec.capacity_tokens or found.capacity_tokens
        self.index.capacity_blocks = index_capacity_blocks(self.capacity_tokens)
        logger.info("backend %s: %s engine, model %s, KV capacity %s tokens", self.url, self.engine.value,
                    self.model, self.capacity_tokens or "unknown")

    def load_read(self, queued_requests: float, running_requests: float, kv_usage: float) -> None:
        """A scrape of the backend's /metrics, stamped with the time and with our requests then prefilling."""
        self.signals = LoadSignals(queued_requests, running_requests, kv_usage, read_at_s=time.monotonic(),
                                   ours_prefilling=self.prefilling)

    def start_time_read(self, started_at_s: float) -> None:
        """The engine process's start time (`process_start_time_seconds` in its /metrics). One that moved means the
        engine restarted behind the same URL, with an empty cache, even between two health checks."""
        known, self.started_at_s = self.started_at_s, started_at_s
        if known is not None and abs(started_at_s - known) > RESTART_TOLERANCE_S:
            self.restarted(f"its process start time moved from {known:.0f} to {started_at_s:.0f}")

    def restarted(self, evidence: str) -> None:
        """The engine behind the URL started afresh: forget what we thought it cached, here and in the other
        gateway instances."""
        logger.warning("backend %s restarted (%s); its prefix index is cleared", self.url, evidence)
        self.index.clear()
        self.publisher.cleared(self)

    def _mark_down(self, reason: str) -> None:
        if self.healthy:
            self.publisher.marked_down(self)
        self.take_out(reason)

    def take_out(self, reason: str) -> None:
        """Out of rotation, its cache forgotten, without telling the other gateway instances: for a verdict that
        came from one of them (`shared_state.py`)."""
        if self.healthy:
            logger.warning("backend %s marked unhealthy: %s", self.url, reason)
        self.healthy = False
        # An engine that went away and comes back has an empty cache; forget what we thought it held.
        self.index.clear()

    def _mark_up(self) -> None:
        logger.info("backend %s healthy (model %s)", self.url, self.model)
        self.healthy = True
        if self.outlier.ejected:
            logger.info("backend %s returns to service: it passes health checks again", self.url)
        self.outlier.reset()  # back from down: whatever ejected it before is history

    def describe(self) -> dict[str, Any]:
        """The read-only view served at GET /backends."""
        return {
            "name": self.name, "url": self.url, "model": self.model, "other_models": sorted(self.other_models),
            "source": self.source, "draining": self.draining,
            "engine": self.engine.value if self.engine else None, "healthy": self.healthy,
            "ejected": self.outlier.ejected, "outlier": self.outlier.describe(),
            "in_flight": self.in_flight, "remote_in_flight": self.remote.in_flight,
            "pending_prefill_tokens": self.pending_prefill_tokens,
            "queued_prefill_tokens": round(self.backlog.remaining_tokens(time.monotonic())),
            "remote_queued_prefill_tokens": self.remote.prefill_tokens,
            "prefill_tokens_per_s": self.backlog.tokens_per_s,
            "active_blocks": self.active_blocks,
            "capacity_tokens": self.capacity_tokens, "index_blocks": self.index.size_blocks,
            "index_capacity_blocks": self.index.capacity_blocks,
            "signals": None if self.signals is None else {
                "queued_requests": self.signals.queued_requests,
                "running_requests": self.signals.running_requests, "kv_usage": self.signals.kv_usage},
        }
