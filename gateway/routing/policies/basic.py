"""Policies that ignore the prompt: round robin, random, least load, power of two choices.

They are the baselines; `Decision.matched_blocks` is still filled in so every route reports its prefix match.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.fleet.backends import Backend
from gateway.routing.policies import Decision, PolicyConfig, Route, RoutingRequest


@dataclass(frozen=True)
class SeededConfig(PolicyConfig):
    seed: int | None = None  # None: a fresh random sequence per gateway; tests fix it


def decide(backend: Backend, route: Route, request: RoutingRequest) -> Decision:
    return Decision(backend, route, backend.index.match(request.hashes))


def least_loaded(backends: Sequence[Backend], start: int = 0) -> Backend:
    """The backend with the fewest in-flight requests (from every instance sharing state); ties go to the first at
    or after `start` (rotating it spreads ties instead of piling them onto the first registered backend)."""
    count = len(backends)
    rotated = [backends[(start + i) % count] for i in range(count)]
    return min(rotated, key=lambda backend: backend.fleet_in_flight)


class RoundRobin:
    name = "round_robin"

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._next_by_model: dict[str | None, int] = {}

    def choose(self, backends: Sequence[Backend], request: RoutingRequest) -> Decision:
        model = backends[0].model
        turn = self._next_by_model.get(model, 0)
        self._next_by_model[model] = turn + 1
        return decide(backends[turn % len(backends)], Route.ROUND_ROBIN, request)


class Random:
    name = "random"

    def __init__(self, config: SeededConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)

    def choose(self, backends: Sequence[Backend], request: RoutingRequest) -> Decision:
        return decide(self._rng.choice(backends), Route.RANDOM, request)


class LeastLoad:
    name = "least_load"

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._ties = 0

    def choose(self, backends: Sequence[Backend], request: RoutingRequest) -> Decision:
        self._ties += 1
        return decide(least_loaded(backends, self._ties), Route.LEAST_LOAD, request)


class PowerOfTwo:
    """Two backends at random, the less loaded of them: near least-load balance without a global scan."""

    name = "power_of_two"

    def __init__(self, config: SeededConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)

    def choose(self, backends: Sequence[Backend], request: RoutingRequest) -> Decision:
        pair = self._rng.sample(list(backends), 2) if len(backends) > 1 else list(backends)
        return decide(min(pair, key=lambda backend: backend.fleet_in_flight), Route.POWER_OF_TWO, request)
