"""The backends (engine replicas) behind the gateway: what each serves, whether it is healthy, how loaded it is.

A `Backend` is mutable state owned by the event loop and changed only through its own methods: the health checker
reports checks, discoveries and load readings; the router reserves and releases load; the record step reports how
each exchange ended (outlier ejection, outlier.py); policies only read. `Pool` answers "which backends may serve
model M right now", and changes at run time (`add`, `drain`, `remove`: discovery.py and the admin API): a
draining backend is never chosen, its requests in flight finish, and it leaves (its index freed) once none is left.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.errors import BadRequest, ModelNotFound, NoHealthyBackend
from gateway.fleet.engines import Engine, EngineInfo, ModelInfo
from gateway.fleet.outlier import FAILED_STATUSES, Ejection, Outlier, OutlierConfig
from gateway.fleet.upstream import Failure
from gateway.routing.backlog import PendingPrefill, PrefillBacklog
from gateway.routing.hashing import namespace_seed
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
    Every call only appends to a local buffer: it never waits and never fails."""

    def placed(self, backend: Backend, hashes: Sequence[int]) -> None: ...

    def corrected(self, backend: Backend, hashes: Sequence[int], keep_blocks: int) -> None: ...

    def marked_down(self, backend: Backend) -> None: ...

    def cleared(self, backend: Backend) -> None: ...


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
    _active_refs: collections.Counter[int] = field(default_factory=collections.Counter, repr=False)
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
        return len(self._active_refs)

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
        self._active_refs.update(hashes)
        return self.backlog.add(prefill_tokens, time.monotonic())

    def prefill_done(self, pending: PendingPrefill) -> None:
        self.backlog.finish(pending, time.monotonic())

    def prefill_dropped(self, pending: PendingPrefill) -> None:
        self.backlog.drop(pending, time.monotonic())

    def release(self, hashes: Sequence[int]) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        refs = self._active_refs
        for block in hashes:
            count = refs[block] - 1
            if count > 0:
                refs[block] = count
            else:
                refs.pop(block, None)

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
            "prefill_tokens_per_s": self.backlog.tokens_per_s,
            "active_blocks": self.active_blocks,
            "capacity_tokens": self.capacity_tokens, "index_blocks": self.index.size_blocks,
            "index_capacity_blocks": self.index.capacity_blocks,
            "signals": None if self.signals is None else {
                "queued_requests": self.signals.queued_requests,
                "running_requests": self.signals.running_requests, "kv_usage": self.signals.kv_usage},
        }


def sglang_adapter(requested: str | None, lora_path: Any, adapters: Mapping[str, int]) -> str | None:
    """The LoRA adapter a request names SGLang's ways, if it is one of `adapters`: `model` as "base:adapter"
    first (SGLang's priority), then a `lora_path` field naming it; None otherwise."""
    if requested is not None and ":" in requested:
        adapter = requested.rsplit(":", 1)[1]
        if adapter in adapters:
            return adapter
    return lora_path if isinstance(lora_path, str) and lora_path in adapters else None


class Pool:
    """All backends, in the order they were configured or added (the order ties are broken in where a policy must).

    Backends join (`add`: unhealthy until their first good health check), drain (`drain`: chosen for nothing
    new) and leave (`remove`, once nothing of theirs is in flight: discovery.py's `Membership` waits for that).
    `version` moves on each join and leave, for those who keep something per backend (shared_state.py)."""

    def __init__(self, specs: Sequence[BackendSpec], index_capacity_blocks: int, retry_after_s: int,
                 outlier: OutlierConfig = OutlierConfig()) -> None:
        self._clock = itertools.count(1).__next__  # shared so index timestamps compare across backends
        self._index_capacity_blocks = index_capacity_blocks
        self._outlier = outlier
        self._retry_after_s = retry_after_s
        self.publisher: Publisher = NOT_SHARED  # given to every backend, those added later too
        self.version = 0
        self.backends: list[Backend] = []
        # The block-hash seed (hashing.py) of each model a backend serves beside its first: a LoRA adapter, or
        # another model of a multi-model server. The engine caches each apart, so the index keeps them apart; a
        # backend's first model hashes from the root seed, as in a fleet of one model per backend.
        self.model_seeds: dict[str, int] = {}
        for spec in specs:
            self.add(spec)

    def models_changed(self) -> None:
        """A backend's discovery changed what it serves: learn the seeds anew."""
        self.model_seeds = {name: namespace_seed(name) for b in self.backends for name in b.other_models}

    def add(self, spec: BackendSpec, source: str = "config") -> Backend:
        """A new backend, out of rotation until its health checks pass; ValueError when its URL or name is taken."""
        spec = dataclasses.replace(spec, url=spec.url.rstrip("/"))
        taken = self.find(spec.url) or (self.find(spec.name) if spec.name else None)
        if taken is not None:
            raise ValueError(f"backend {taken.name} ({taken.url}) already has that "
                             f"{'URL' if taken.url == spec.url else 'name'}")
        backend = Backend(spec, PrefixIndex(self._index_capacity_blocks, self._clock), model=spec.model,
                          capacity_tokens=spec.capacity_tokens, outlier=Outlier(self._outlier), source=source,
                          publisher=self.publisher)
        self.backends.append(backend)
        self.version += 1
        return backend

    def drain(self, backend: Backend) -> None:
        """Choose `backend` for nothing new; what it is serving finishes."""
        if not backend.draining:
            logger.info("backend %s draining: %d requests in flight", backend.url, backend.in_flight)
        backend.draining = True

    def remove(self, backend: Backend) -> None:
        """`backend` leaves the pool and its index is freed. Anything still holding it (a request in flight, a
        remembered stored response) sees it unhealthy."""
        if backend in self.backends:
            self.backends.remove(backend)
            self.version += 1
            logger.info("backend %s removed", backend.url)
        backend.draining = True
        backend.healthy = False
        backend.index.clear()

    def find(self, key: str) -> Backend | None:
        """The backend of that name or URL."""
        key = key.rstrip("/")
        return next((b for b in self.backends if key in (b.name, b.url)), None)

    def models(self, healthy_only: bool = True) -> list[str]:
        """The models served; a draining backend's only by those still serving them."""
        names: set[str] = set()
        for backend in self.backends:
            if backend.model and not backend.draining and (backend.healthy or not healthy_only):
                names.add(backend.model)
                names.update(backend.other_models)
        return sorted(names)

    def resolve_model(self, requested: str | None, default_model: str | None, lora_path: Any = None) -> str:
        """The model a request is for: as named, else the default, else the only one there is. A model no
        backend serves is unknown only once every backend has said what it serves: until then it may be the
        one still loading, and the client is told to come back (503), not that it does not exist (404).
        An adapter named SGLang's ways (`lora_path`, or `model` as "base:adapter") is the model it is for."""
        if lora_path is None and requested is not None:
            for backend in self.backends:  # the common case, without listing every model
                if backend.model == requested:
                    return requested
        known = self.models(healthy_only=False)
        if lora_path is not None or (requested is not None and requested not in known):
            requested = sglang_adapter(requested, lora_path, self.model_seeds) or requested
        if requested is not None:
            if requested in known:
                return requested
            silent = sum(1 for b in self.backends if b.model is None and not b.draining)
            if silent:
                raise NoHealthyBackend(f"No backend that has answered serves the model '{requested}'; {silent} of "
                                       f"{len(self.backends)} backends have not answered yet.", self._retry_after_s)
            raise ModelNotFound(requested, known)
        if default_model is not None:
            return default_model
        if len(known) == 1:
            return known[0]
        if not known:
            raise NoHealthyBackend("No backend has answered yet, so no model is known.", self._retry_after_s)
        raise BadRequest(f"'model' is required: this gateway serves {self._served()}.", param="model")

    def _served(self) -> str:
        """The known models, embedding models (where the engine says so) named apart from the others."""
        embedding = {b.model for b in self.backends if b.model and b.embedding}
        others = [model for model in self.models(healthy_only=False) if model not in embedding]
        if not embedding:
            return ", ".join(others)
        listed = ", ".join(sorted(embedding))
        return f"{', '.join(others)} (embedding models: {listed})" if others else f"embedding models: {listed}"

    def serving(self, model: str, exclude: Iterable[Backend] = ()) -> list[Backend]:
        """The healthy backends of `model` that ejection admits, less `exclude` and those draining. When ejection
        admits none of them, all of them (Envoy's panic routing): ejection steers traffic away from a failing
        backend, it never refuses what the backends might still serve."""
        excluded = set(exclude)
        healthy = [b for b in self.backends
                   if b.healthy and not b.draining and b.serves(model) and b not in excluded]
        return [b for b in healthy if b.outlier.admits()] or healthy

    def candidates(self, model: str, exclude: Iterable[Backend] = ()) -> list[Backend]:
        """As `serving`, but raises NoHealthyBackend rather than return none."""
        found = self.serving(model, exclude)
        if not found:
            raise NoHealthyBackend(f"No healthy backend serves the model '{model}'.", self._retry_after_s)
        return found

    def model_cards(self) -> list[dict[str, Any]]:
        """The union of the healthy backends' model entries, one per model id, for GET /v1/models."""
        cards: dict[str, dict[str, Any]] = {}
        for backend in self.backends:
            if backend.healthy and not backend.draining and backend.model:
                if backend.model not in cards:
                    cards[backend.model] = backend.model_card or {
                        "id": backend.model, "object": "model", "created": 0, "owned_by": "prefix-gateway"}
                for name, card in backend.other_models.items():
                    cards.setdefault(name, card)
        return [cards[model] for model in sorted(cards)]

    def ready(self) -> bool:
        """Every model any backend is known to serve has at least one healthy backend."""
        known = set(self.models(healthy_only=False))
        return bool(known) and known == set(self.models(healthy_only=True))
