"""The backends (engine replicas) behind the gateway: what each serves, whether it is healthy, how loaded it is.

A `Backend` is plain mutable state owned by the event loop: the health checker writes health, model and
capacity; the router reserves and releases load; policies only read. `Pool` answers "which backends may serve
model M right now".
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.backlog import PendingPrefill, PrefillBacklog
from gateway.engines import Engine
from gateway.errors import BadRequest, ModelNotFound, NoHealthyBackend
from gateway.prefix_index import PrefixIndex
from gateway.upstream import Failure

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


@dataclass(eq=False)
class Backend:
    spec: BackendSpec
    index: PrefixIndex
    model: str | None = None
    model_card: dict[str, Any] = field(default_factory=dict)  # the backend's own /v1/models entry
    engine: Engine | None = None  # None until discovered
    healthy: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    capacity_tokens: int | None = None
    in_flight: int = 0
    signals: LoadSignals | None = None
    backlog: PrefillBacklog = field(default_factory=PrefillBacklog, repr=False)  # ours, before first byte
    _active_refs: collections.Counter[int] = field(default_factory=collections.Counter, repr=False)

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def name(self) -> str:
        return self.spec.name or self.spec.url

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

    def exchange_answered(self, status: int) -> None:
        """A request got a complete answer from this backend (any status: 4xx is the client's business)."""

    def exchange_failed(self, failure: Failure, detail: str) -> None:
        """An exchange failed in a way that is this backend's fault. A refused connection takes it out until a
        health check brings it back."""
        if failure is Failure.CONNECT:
            self.mark_down(f"connection failed: {detail}")

    def mark_down(self, reason: str) -> None:
        if self.healthy:
            logger.warning("backend %s marked unhealthy: %s", self.url, reason)
        self.healthy = False
        self.consecutive_successes = 0
        # An engine that went away and comes back has an empty cache; forget what we thought it held.
        self.index.clear()

    def mark_up(self) -> None:
        if not self.healthy:
            logger.info("backend %s healthy (model %s)", self.url, self.model)
        self.healthy = True
        self.consecutive_failures = 0

    def describe(self) -> dict[str, Any]:
        """The read-only view served at GET /backends."""
        return {
            "name": self.name, "url": self.url, "model": self.model, "engine": self.engine.value if self.engine else None, "healthy": self.healthy,
            "in_flight": self.in_flight, "pending_prefill_tokens": self.pending_prefill_tokens,
            "queued_prefill_tokens": round(self.backlog.remaining_tokens(time.monotonic())),
            "prefill_tokens_per_s": self.backlog.tokens_per_s,
            "active_blocks": self.active_blocks,
            "capacity_tokens": self.capacity_tokens, "index_blocks": self.index.size_blocks,
            "index_capacity_blocks": self.index.capacity_blocks,
            "signals": None if self.signals is None else {
                "queued_requests": self.signals.queued_requests,
                "running_requests": self.signals.running_requests, "kv_usage": self.signals.kv_usage},
        }


class Pool:
    """All configured backends, in configuration order (the order ties are broken in where a policy must)."""

    def __init__(self, specs: Sequence[BackendSpec], index_capacity_blocks: int, retry_after_s: int) -> None:
        clock = itertools.count(1).__next__  # shared so index timestamps compare across backends
        self.backends = [Backend(spec, PrefixIndex(index_capacity_blocks, clock), model=spec.model,
                                 capacity_tokens=spec.capacity_tokens) for spec in specs]
        self._retry_after_s = retry_after_s

    def models(self, healthy_only: bool = True) -> list[str]:
        return sorted({b.model for b in self.backends if b.model and (b.healthy or not healthy_only)})

    def resolve_model(self, requested: str | None, default_model: str | None) -> str:
        """The model a request is for: as named, else the default, else the only one there is."""
        known = self.models(healthy_only=False)
        if requested is not None:
            if requested not in known:
                raise ModelNotFound(requested, known)
            return requested
        if default_model is not None:
            return default_model
        if len(known) == 1:
            return known[0]
        if not known:
            raise NoHealthyBackend("No backend has answered yet, so no model is known.", self._retry_after_s)
        raise BadRequest(f"'model' is required: this gateway serves {', '.join(known)}.", param="model")

    def serving(self, model: str, exclude: Iterable[Backend] = ()) -> list[Backend]:
        """The healthy backends of `model`, less `exclude`."""
        excluded = set(exclude)
        return [b for b in self.backends if b.healthy and b.model == model and b not in excluded]

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
            if backend.healthy and backend.model and backend.model not in cards:
                cards[backend.model] = backend.model_card or {
                    "id": backend.model, "object": "model", "created": 0, "owned_by": "prefix-gateway"}
        return [cards[model] for model in sorted(cards)]

    def ready(self) -> bool:
        """Every model any backend is known to serve has at least one healthy backend."""
        known = set(self.models(healthy_only=False))
        return bool(known) and known == set(self.models(healthy_only=True))
