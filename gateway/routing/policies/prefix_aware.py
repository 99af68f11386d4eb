"""`prefix_aware` (the default): weigh the prefill a backend would save against the work it carries.

Every healthy backend gets a cost in prompt tokens; the cheapest wins:

    cost(b) = queued_prefill(b) + affinity(b) * uncached(b)
              + active_weight * active_tokens(b) + decode_weight_tokens * in_flight(b)
              + held_weight * affinity(b) * held_tokens(b)    [only when the request starts a new branch on b]
              - session_weight * affinity(b) * session_tokens(b)    [only with a session key]

- `uncached(b)`: the request's prompt tokens minus those `b` is predicted to hold (its prefix index), i.e. the
  prefill this request would cause there. A conversation therefore follows its own history, not the system
  prompt every backend holds: only the backend its earlier turns went to holds the history.
- `affinity(b)` makes recomputation dearer than waiting: uncached tokens cost the backend prefill time *and*
  evict other prefixes from its cache. The second part grows with how full `b`'s cache is once the request is
  recorded there (`fill`, its index's size over its bound), whole from three quarters full on:
  `affinity(b) = 1 + (affinity_weight - 1) * min(1, fill / FULL_AFFINITY_FILL)`, so 1 on an empty cache and
  `affinity_weight` (default 4) on a cache three quarters full or more. So a prefix stays on its holder
  ("sticky") until the holder's queue exceeds about four times the prefill it saves, then it is replicated onto
  the next backend (route `spill`), which holds it from then on; a hot prefix spreads over as many backends as
  its traffic needs. While other caches are nearly empty a copy costs little more than its prefill, so the
  prefix spreads sooner: this is what partitions conversations behind one system prompt while the caches are
  still empty, before their histories grow to fill them (issue #20: charged four times its 300 tokens
  everywhere, the system prompt kept three replicas taking 40 conversations whose histories then overflowed
  their caches, while the fourth served 7% of the turns).
- `queued_prefill(b)`: uncached prompt tokens of requests sent to `b` that have not produced a first byte yet
  (reserved at decision time, so a burst sees its own placements), less the progress `b` has probably made on
  the oldest of them at the prefill rate it has shown (`gateway/routing/backlog.py`): in a burst that keeps every
  backend busy, a newcomer joins the one about to be free. When `b`'s own `/metrics` are fresher than
  `metrics_max_age_s` and its queue was longer than what we had sent when they were read (traffic from
  elsewhere), each extra request counts as much as ours do on average. For non-streamed requests the first byte
  is the whole answer; the learned rate then errs low, so this overestimates rather than herds.
- `active_tokens(b)`: distinct prompt tokens of the requests running on `b` (a prefix they share counts once),
  the KV memory they pin, weighted by `active_weight` (default 0.15). It is what balances *where long-lived
  work settles*: conversations behind a system prompt held by one backend would otherwise all stay there for
  the few hundred tokens it saves, and their growing histories would overflow that backend's cache while
  another sits idle -- sglang-router's failure on multi-turn chat. A request that shares its running
  neighbours' prefix adds little, so a group of one-shot requests behind one long document still stays
  together. At light load few requests run at once, so this term alone is too weak: see `held_tokens`.
- `held_tokens(b)`: the tokens `b`'s prefix index holds, weighted by `held_weight` (default 0.15) and by
  `affinity(b)`, counted only when the request would start a new branch in `b`'s cache: a cold prompt, or a new
  conversation or question off a prefix others share there (its match ends where another cached prompt
  continues). This is where conversations settle *between* turns, which the active-token term cannot see:
  without it, at light load first turns stay with the system prompt's first holders and a few replicas take
  every conversation. A new branch grows into what the cache holds, so the fuller the cache, the likelier it
  evicts histories still in use: hence `affinity(b)`. Unweighted by it, conversations arriving one by one behind
  a system prompt (`tight-poisson` at light load) settled 35/39/80/86 turns per replica and 29 turns found
  their history evicted; weighted, 49/54/65/72 and 20. A request that continues a prompt `b` holds (its match
  ends at a leaf: a conversation's next turn) is not charged, so a conversation never leaves its history
  because its backend is full of others. The index is LRU-bounded like the engine's cache, so once every
  backend is full the term is equal everywhere and the other terms decide; a question behind a long shared
  document leaves the document's holder only when it holds about `1 / held_weight` (7) times the document's
  length more than another backend as full. It counts tokens, not the share of the cache: in a fleet of unequal
  caches the larger ones get fewer new conversations than their size would allow, except as `affinity(b)`
  (which is relative to each cache's size) tempers it.
- `decode_weight_tokens * in_flight(b)` (default 4): what a running request costs a new one's first token. The
  engine runs prefill before decode (SGLang's default), so a newcomer waits for at most the current decode step,
  to which each running request adds little: about a few prompt tokens' worth of prefill. A queued prefill, by
  contrast, delays it by all its tokens.

- `session_tokens(b)`: with a session key (`x-session-id`, `prompt_cache_key`, `user`: gateway/api/prompts.py),
  the tokens of this prompt that `b` computed for the key's last request -- when that request went to `b` and this
  one continues its prompt (gateway/routing/sessions.py) -- beyond what `b`'s index predicts. One request records
  at most a quarter of an index, so of a long context (an agent's) the index knows only the head, often a system
  prompt every conversation shares: the key knows which backend holds the rest. It is believed while `b`'s index
  still holds the head it recorded, and until that index has evicted, since, as much as the engine keeps for
  prefixes (`index_kv_share` of its reported KV capacity; a backend that reported none gets no credit): then the
  engine has evicted the rest too. `session_weight` (default 1, 0 turns keys off) is how far the key is believed.
  Where the index holds the whole history the term is 0: a key never adds stickiness beyond the cache it stands
  for, so a key's backend keeps it exactly while a held prefix would keep it (the guard rail below applies as to
  any request), and when moving pays the key moves and is remembered at its new backend. Without a key, or for a
  request that does not continue its key's last prompt (a new conversation of the same `user`), nothing changes.

Equal costs go to the backend whose index is emptiest, then by rotation, so new prefixes spread instead of
piling onto the first backend.

Guard rail, with sglang-router's knobs: a backend more than `balance_abs_threshold` requests and
`balance_rel_threshold` times above the least loaded one is not chosen while another is available. Unlike
sglang-router's imbalance gate this never throws affinity away fleet-wide: only that backend is skipped.
`cache_threshold` labels the route: `prefix` when the chosen backend holds the deepest match and it covers at
least that share of the prompt, `spill` when another backend held more, `least-load` otherwise; `session` when the
backend holds the session key's history beyond what its index predicts.

With shared state (`--state`, `shared_state.py`), the in-flight requests, queued prefill and active tokens of
the other gateway instances (`Backend.remote`, at most a flush old) count as this instance's own; their queued
requests are then no longer "traffic from elsewhere" in the engine's queue. The indexes hold every instance's
placements.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.fleet.backends import Backend
from gateway.routing.policies import Decision, PolicyConfig, Route, RoutingRequest

# The fill at which a copy is charged the whole affinity weight. Charged in proportion to the fill up to a full
# cache, busy prefixes were copied (spilled) too soon while caches had room: b2b-saas under overload, whose
# prefixes never fill them, lost 1-2.4 points of hits to cache_aware. Charged whole from half full, they stayed
# too long on their holders: shared-prefix's p99 TTFT under overload rose from 0.67x cache_aware's to 1.21x.
# At three quarters both hold, and the empty caches of tight's start still partition its conversations.
FULL_AFFINITY_FILL = 0.75


@dataclass(frozen=True)
class PrefixAwareConfig(PolicyConfig):
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    decode_weight_tokens: float = 4.0
    affinity_weight: float = 4.0
    active_weight: float = 0.15
    held_weight: float = 0.15
    session_weight: float = 1.0
    metrics_max_age_s: float = 2.0
    # Share of a backend's KV capacity its prefix index models: the engine keeps the rest for running requests,
    # and predicting a hit it already evicted costs more than missing one.
    index_kv_share: float = 0.85

    @property
    def index_share(self) -> float:
        return self.index_kv_share

    @property
    def follows_sessions(self) -> bool:
        return self.session_weight > 0


class PrefixAware:
    name = "prefix_aware"

    def __init__(self, config: PrefixAwareConfig) -> None:
        self.config = config
        self._turn = 0

    def choose(self, backends: Sequence[Backend], request: RoutingRequest) -> Decision:
        self._turn += 1
        eligible = self._not_saturated(backends)
        matches = {id(b): b.index.match(request.hashes) for b in eligible}
        vouched = {id(b): self.session_blocks(b, matches[id(b)], request) for b in eligible} \
            if request.last_visit is not None else {}
        chosen = self._cheapest(eligible, matches, vouched, request)
        matched, deepest = matches[id(chosen)], max(matches.values())
        if not deepest or request.match_fraction(deepest) < self.config.cache_threshold:
            route = Route.LEAST_LOAD
        else:
            route = Route.PREFIX if matched == deepest else Route.SPILL
        if vouched.get(id(chosen), 0) > matched:
            route = Route.SESSION
        return Decision(chosen, route, matched)

    def cost(self, backend: Backend, matched_blocks: int, request: RoutingRequest, session_blocks: int = 0) -> float:
        """`session_blocks`: what the request's session key vouches `backend` holds (`session_blocks()`)."""
        config = self.config
        uncached = request.uncached_tokens(matched_blocks)
        affinity = self.affinity(backend, matched_blocks, request)
        now_s = time.monotonic()
        cost = (self.queued_prefill(backend, uncached, now_s) + affinity * uncached
                + config.active_weight * request.block_tokens(backend.active_blocks + backend.remote.active_blocks)
                + config.decode_weight_tokens * backend.fleet_in_flight)
        continues_session = session_blocks > matched_blocks  # the key's last prompt, beyond what the index knows
        if continues_session:
            cost -= config.session_weight * affinity * (uncached - request.uncached_tokens(session_blocks))
        if not continues_session and _starts_branch(backend, matched_blocks, request):
            # A new branch grows into what the cache holds: the fuller it is, the likelier it evicts live histories.
            cost += config.held_weight * affinity * request.block_tokens(backend.index.size_blocks)
        return cost

    def affinity(self, backend: Backend, matched_blocks: int, request: RoutingRequest) -> float:
        """What one uncached token costs on `backend`: its prefill, plus what it evicts. That second part grows
        with how full the cache would be once the request is cached there, whole from `FULL_AFFINITY_FILL` on:
        nothing is evicted from room to spare, but a copy made now takes room that later content will need."""
        index = backend.index
        fill = min(1.0, (index.size_blocks + len(request.hashes) - matched_blocks) / index.capacity_blocks)
        return 1.0 + (self.config.affinity_weight - 1.0) * min(1.0, fill / FULL_AFFINITY_FILL)

    def session_blocks(self, backend: Backend, matched_blocks: int, request: RoutingRequest) -> int:
        """Blocks of the request that `backend` computed for its session's last prompt and probably still holds:
        while its index still holds the part of that prompt it recorded (the engine keeps what the index does),
        and until the index has evicted, since, as much as the engine keeps for prefixes (`index_kv_share` of its
        reported KV capacity): then the rest is gone from the engine too."""
        visit = request.last_visit
        if visit is None or matched_blocks < visit.recorded_blocks or not backend.capacity_tokens:
            return 0
        blocks = visit.continued_blocks(backend, request.hashes)
        engine_blocks = backend.capacity_tokens * self.config.index_kv_share * request.chars_per_token \
            / request.block_chars
        return blocks if visit.pushed_out() + blocks <= engine_blocks else 0

    def queued_prefill(self, backend: Backend, uncached: int, now_s: float) -> float:
        """Our own reserved prefill, plus the engine's queue beyond what we sent (traffic from elsewhere), each
        such request assumed to cost what ours cost on average there (or this one, when none of ours waits)."""
        queued = backend.backlog.remaining_tokens(now_s) + backend.remote.prefill_tokens
        signals = backend.signals
        if signals is not None and now_s - signals.read_at_s <= self.config.metrics_max_age_s:
            unknown = signals.queued_requests - signals.ours_prefilling - backend.remote.prefilling
            if unknown > 0:
                each = backend.pending_prefill_tokens / backend.prefilling if backend.prefilling else uncached
                queued += unknown * each
        return queued

    def _cheapest(self, backends: Sequence[Backend], matches: dict[int, int], vouched: dict[int, int],
                  request: RoutingRequest) -> Backend:
        """Least cost; ties to the emptiest index (room for a new prefix), then by rotation. One candidate (a
        sidecar's replica, the last healthy one) is chosen without costing it."""
        count = len(backends)
        if count == 1:
            return backends[0]
        rotated = [backends[(self._turn + i) % count] for i in range(count)]
        return min(rotated, key=lambda b: (self.cost(b, matches[id(b)], request, vouched.get(id(b), 0)),
                                           b.index.size_blocks / b.index.capacity_blocks))

    def _not_saturated(self, backends: Sequence[Backend]) -> Sequence[Backend]:
        if len(backends) == 1:  # a lone backend is the least loaded one: nothing to compare (a sidecar's case)
            return backends
        low = min(backend.fleet_in_flight for backend in backends)
        gap, factor = self.config.balance_abs_threshold, self.config.balance_rel_threshold
        return [b for b in backends if not (b.fleet_in_flight - low > gap and b.fleet_in_flight > low * factor)]


def _starts_branch(backend: Backend, matched_blocks: int, request: RoutingRequest) -> bool:
    """Whether the request would start a new line of content in `backend`'s cache (a cold prompt, or a new
    conversation or question off a prefix others share) rather than continue a prompt it holds."""
    if matched_blocks == len(request.hashes):
        return False
    return matched_blocks == 0 or not backend.index.is_leaf(request.hashes[matched_blocks - 1])
