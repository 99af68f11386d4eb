"""The pool of backends: which may serve model M right now, and how the pool changes at run time.

`Pool` answers "which backends may serve model M right now" and resolves the model a request names (LoRA adapters
and other models a backend serves included). It changes at run time (`add`, `drain`, `remove`: discovery.py and
the admin API): a draining backend is never chosen, its requests in flight finish, and it leaves (its index freed)
once none is left. Each `Backend` (backends.py) owns its own state.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gateway.errors import BadRequest, ModelNotFound, NoHealthyBackend
from gateway.fleet.backends import NOT_SHARED, Backend, BackendSpec, Publisher
from gateway.fleet.outlier import Outlier, OutlierConfig
from gateway.routing.hashing import namespace_seed
from gateway.routing.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)


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
