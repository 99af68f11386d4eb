"""`prefix_aware` (the default): sticky to the deepest cached prefix until its holder saturates.

Per request, with `match(b)` the blocks of the prompt backend `b` is predicted to hold (its prefix index):

1. **Affinity.** If some backend holds at least `cache_threshold` of the prompt, the *owners* are the backends
   with the deepest match. A conversation therefore follows its own history, not the system prompt every
   backend holds: only the backend its earlier turns went to holds the history. Among several owners (a hot
   prefix already replicated) the least loaded one is taken.
2. **Sticky until saturated.** The owner is kept unless its queued prefill exceeds `spill_threshold_tokens`
   (default 8192, one chunked-prefill batch of SGLang: about 0.3 s of prefill for an 8B model on an H100).
   Then the request goes to the backend of least estimated cost (below), usually one that holds a shorter
   prefix (route `spill`). The spill target caches the prefix too and becomes an owner, so a hot prefix is
   replicated onto as many backends as its traffic needs, and no more.
3. **Cold prompts** (no useful match anywhere) go to the backend of least cost; on equal costs the one whose
   index is emptiest, then rotation, so new prefixes spread instead of piling onto the first backend
   (sglang-router's ties go to the first worker).

Load is an estimate, in prompt tokens, of the work ahead of this request on a backend:

    cost(b) = queued_prefill(b) + uncached(b) + decode_weight_tokens * in_flight(b)

`queued_prefill(b)` is the uncached prompt tokens of requests sent to `b` that have not produced a first byte
yet (reserved at decision time, so a burst sees its own placements), or, when `b`'s own `/metrics` are fresher
than `signal_max_age_s` and show a longer queue (traffic from elsewhere), that queue times this request's
prompt length. `uncached(b)` is the prefill this request would cause there. `decode_weight_tokens * in_flight`
stands for the decode steps and KV memory running requests take.

Guard rail, with sglang-router's knobs: a backend more than `balance_abs_threshold` requests and
`balance_rel_threshold` times above the least loaded one is not chosen while another is available, whatever
it holds. Unlike sglang-router's imbalance gate this never throws affinity away fleet-wide: only the
overloaded backend is skipped, and the next-best holder of the prefix is still preferred.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from gateway.backends import Backend
from gateway.policies import Decision, Route, RoutingRequest


class PrefixAware:
    name = "prefix_aware"

    def __init__(self, cache_threshold: float, balance_abs_threshold: int, balance_rel_threshold: float,
                 decode_weight_tokens: float = 16.0, spill_threshold_tokens: int = 8192,
                 signal_max_age_s: float = 2.0) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.decode_weight_tokens = decode_weight_tokens
        self.spill_threshold_tokens = spill_threshold_tokens
        self.signal_max_age_s = signal_max_age_s
        self._turn = 0

    def choose(self, backends: Sequence[Backend], request: RoutingRequest) -> Decision:
        self._turn += 1
        eligible = self._not_saturated(backends)
        matches = {id(b): b.index.match(request.hashes) for b in eligible}
        deepest = max(matches.values())
        if deepest and request.match_fraction(deepest) >= self.cache_threshold:
            owners = [b for b in eligible if matches[id(b)] == deepest]
            owner = self._cheapest(owners, matches, request)
            if self.queued_prefill(owner, request) <= self.spill_threshold_tokens:
                return Decision(owner, Route.PREFIX, deepest)
            chosen = self._cheapest(eligible, matches, request)
            route = Route.PREFIX if matches[id(chosen)] == deepest else Route.SPILL
            return Decision(chosen, route, matches[id(chosen)])
        chosen = self._cheapest(eligible, matches, request)
        return Decision(chosen, Route.LEAST_LOAD, matches[id(chosen)])

    def cost(self, backend: Backend, matched_blocks: int, request: RoutingRequest) -> float:
        uncached = max(0, request.prompt_tokens - request.tokens(matched_blocks * request.block_chars))
        return self.queued_prefill(backend, request) + uncached + self.decode_weight_tokens * backend.in_flight

    def queued_prefill(self, backend: Backend, request: RoutingRequest) -> float:
        queued = float(backend.pending_prefill_tokens)
        signals = backend.signals
        if signals is not None and time.monotonic() - signals.read_at_s <= self.signal_max_age_s:
            queued = max(queued, signals.queued_requests * request.prompt_tokens)
        return queued

    def _cheapest(self, backends: Sequence[Backend], matches: dict[int, int], request: RoutingRequest) -> Backend:
        """Least cost; ties to the emptiest index (room for a new prefix), then by rotation."""
        count = len(backends)
        rotated = [backends[(self._turn + i) % count] for i in range(count)]
        return min(rotated, key=lambda b: (self.cost(b, matches[id(b)], request),
                                           b.index.size_blocks / b.index.capacity_blocks))

    def _not_saturated(self, backends: Sequence[Backend]) -> list[Backend]:
        low = min(backend.in_flight for backend in backends)
        return [b for b in backends
                if not (b.in_flight - low > self.balance_abs_threshold and b.in_flight > low * self.balance_rel_threshold)]
