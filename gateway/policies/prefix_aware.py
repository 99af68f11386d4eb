"""`prefix_aware` (the default): go where the prompt's prefix is cached, unless waiting there costs more.

Every healthy backend gets a cost in prompt tokens, an estimate of the work standing between this request and
its first token on that backend:

    cost(b) = queued_prefill(b) + uncached(b) + decode_weight_tokens * in_flight(b)

- `uncached(b)`: the request's prompt tokens minus those `b` is predicted to hold (its prefix index), i.e. the
  prefill this request would cause there. A conversation therefore follows its own history, not the system
  prompt every backend holds, because its history is cached only where its earlier turns went.
- `queued_prefill(b)`: uncached prompt tokens of requests already sent to `b` that have not produced a first
  byte yet (reserved at decision time, so a burst sees its own placements), or, when `b`'s own `/metrics`
  report is fresh (younger than `signal_max_age_s`) and shows a longer queue (traffic from elsewhere), that
  queue times this request's prompt length, the best stand-in for the queued prompts we did not see.
- `decode_weight_tokens * in_flight(b)`: running requests slow every decode step and hold KV memory.

The cheapest backend wins; equal costs rotate (cold prefixes spread instead of piling onto the first backend).
This is "sticky until saturated": a hot prefix stays on its owner until the owner's queue outweighs
recomputing the prefix elsewhere, then it is *replicated* onto the next backend (route `spill`), which from
then on is an owner too.

Guard rail, with sglang-router's knobs: a backend more than `balance_abs_threshold` requests and
`balance_rel_threshold` times above the least loaded one is not chosen while another is available.
`cache_threshold` only labels the route (`prefix` when the chosen backend holds at least that share).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from gateway.backends import Backend
from gateway.policies import Decision, Route, RoutingRequest


class PrefixAware:
    name = "prefix_aware"

    def __init__(self, cache_threshold: float, balance_abs_threshold: int, balance_rel_threshold: float,
                 decode_weight_tokens: float = 16.0, signal_max_age_s: float = 2.0) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.decode_weight_tokens = decode_weight_tokens
        self.signal_max_age_s = signal_max_age_s
        self._turn = 0

    def choose(self, backends: Sequence[Backend], request: RoutingRequest) -> Decision:
        self._turn += 1
        matches = [backend.index.match(request.hashes) for backend in backends]
        allowed = self._not_saturated(backends)
        count = len(backends)
        order = [(self._turn + i) % count for i in range(count)]  # rotation breaks ties fairly
        best = min((i for i in order if allowed[i]), key=lambda i: self.cost(backends[i], matches[i], request))
        return Decision(backends[best], self._route(matches, best, request), matches[best])

    def cost(self, backend: Backend, matched_blocks: int, request: RoutingRequest) -> float:
        uncached = max(0, request.prompt_tokens - request.tokens(matched_blocks * request.block_chars))
        return self.queued_prefill(backend, request) + uncached + self.decode_weight_tokens * backend.in_flight

    def queued_prefill(self, backend: Backend, request: RoutingRequest) -> float:
        queued = float(backend.pending_prefill_tokens)
        signals = backend.signals
        if signals is not None and time.monotonic() - signals.read_at_s <= self.signal_max_age_s:
            queued = max(queued, signals.queued_requests * request.prompt_tokens)
        return queued

    def _not_saturated(self, backends: Sequence[Backend]) -> list[bool]:
        low = min(backend.in_flight for backend in backends)
        return [not (b.in_flight - low > self.balance_abs_threshold and b.in_flight > low * self.balance_rel_threshold)
                for b in backends]

    def _route(self, matches: Sequence[int], best: int, request: RoutingRequest) -> Route:
        deepest = max(matches)
        if request.match_fraction(deepest) < self.cache_threshold or not deepest:
            return Route.LEAST_LOAD
        return Route.PREFIX if matches[best] == deepest else Route.SPILL
