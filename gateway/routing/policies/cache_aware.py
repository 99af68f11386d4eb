"""`cache_aware`: sglang-router 0.3.x's cache-aware policy, reproduced as the baseline we measure against.

The algorithm, per request (loads are in-flight request counts, reserved at selection):

1. If the fleet is imbalanced — `max_load - min_load > balance_abs_threshold` and
   `max_load > min_load * balance_rel_threshold` — take the least loaded backend (ties: first configured),
   ignoring the prompt entirely.
2. Otherwise find the backend holding the longest prefix of the prompt. If the matched share of the prompt is
   above `cache_threshold`, take it (ties: the backend that cached that prefix first).
3. Else take the least loaded backend (ties: first configured).

Knobs keep sglang-router's names and defaults: `cache_threshold` 0.3, `balance_abs_threshold` 64,
`balance_rel_threshold` 1.5. Differences we accept: sglang matches characters in one shared tree, we match
64-character blocks in per-backend indexes (the same question, answered at block granularity), and our indexes
are bounded by what each backend can hold rather than by `max_tree_size` characters alone.

Its weaknesses are kept on purpose, so that the baseline is the policy as deployed: a shared system prompt
above the threshold pins all traffic to its first owner until the imbalance gate trips, ties favour the first
backend, and rebalancing throws affinity away. `prefix_aware` is the policy that fixes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.fleet.backends import Backend
from gateway.routing.policies import Decision, PolicyConfig, Route, RoutingRequest


@dataclass(frozen=True)
class CacheAwareConfig(PolicyConfig):
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5


class CacheAware:
    name = "cache_aware"

    def __init__(self, config: CacheAwareConfig) -> None:
        self.config = config

    def choose(self, backends: Sequence[Backend], request: RoutingRequest) -> Decision:
        matches = [backend.index.match(request.hashes) for backend in backends]
        least = min(range(len(backends)), key=lambda i: backends[i].fleet_in_flight)  # first on ties
        if self._imbalanced(backends):
            return Decision(backends[least], Route.IMBALANCE, matches[least])
        deepest = max(matches)
        if deepest and request.match_fraction(deepest) > self.config.cache_threshold:
            owners = [i for i, blocks in enumerate(matches) if blocks == deepest]
            first_owner = min(owners, key=lambda i: backends[i].index.created_at(request.hashes[deepest - 1]))
            return Decision(backends[first_owner], Route.PREFIX, deepest)
        return Decision(backends[least], Route.LEAST_LOAD, matches[least])

    def _imbalanced(self, backends: Sequence[Backend]) -> bool:
        loads = [backend.fleet_in_flight for backend in backends]
        high, low = max(loads), min(loads)
        config = self.config
        return high - low > config.balance_abs_threshold and high > low * config.balance_rel_threshold
