"""The *choose* step: filter the backends that may serve a request, let the policy pick, reserve the pick.

Reserving happens in the same synchronous call as the decision — load counted, prompt recorded in the chosen
backend's prefix index — so a burst of requests with one new prefix sees its own placements instead of all
landing where the prefix was not yet recorded. A `Placement` releases what it reserved exactly once, whatever
way the request ends.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.fleet.backends import Backend
from gateway.fleet.pool import Pool
from gateway.routing.hashing import ROOT_SEED, PrefixHashes, namespace_seed
from gateway.routing.policies import Decision, PolicyConfig, Route, RoutingRequest
from gateway.routing.policies.basic import least_loaded
from gateway.routing.policies.registry import DEFAULT_POLICY, default_config, make_policy
from gateway.routing.sessions import Sessions, Visit, key_hash

# A backend reporting less than this share of the predicted cached tokens has evicted that prefix.
EVICTION_EVIDENCE_RATIO = 0.5
MAX_SEEDS = 4096  # model names whose block-hash seed the router keeps


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = DEFAULT_POLICY
    policy_config: PolicyConfig = field(default_factory=default_config)  # the knobs of `policy`
    block_chars: int = 64
    chars_per_token: float = 4.0
    session_max_keys: int = 100_000  # session keys remembered (gateway/routing/sessions.py)
    session_ttl_s: float = 3600.0


class Placement:
    """A decision and the load it reserved on its backend, until `first_byte()` and `finish()`."""

    def __init__(self, decision: Decision, request: RoutingRequest) -> None:
        self.decision = decision
        self.request = request
        self.predicted_cached_tokens = request.block_tokens(decision.matched_blocks)
        self.prefill_tokens = request.uncached_tokens(decision.matched_blocks)
        self._prefilling = True
        self._finished = False
        self.placed_s = time.monotonic()
        self._pending_prefill = decision.backend.reserve(self.prefill_tokens, request.hashes)
        self._probe = decision.backend.outlier.probe_started()  # the one request a half-open backend takes

    @property
    def backend(self) -> Backend:
        return self.decision.backend

    @property
    def match_fraction(self) -> float:
        return self.request.match_fraction(self.decision.matched_blocks)

    def first_byte(self) -> None:
        """A good answer started (the relay calls this only for status < 400)."""
        if self._prefilling:
            self._prefilling = False
            self.backend.prefill_done(self._pending_prefill)
            if self._probe:  # a half-open backend generates again: no need to wait for a long answer's end
                self.backend.answer_started()

    def learn(self, reported_cached_tokens: int) -> bool:
        """Correct the index when the backend reports far fewer cached tokens than predicted: it had evicted
        that part of the prefix, and with it every prompt branching below (an engine evicts leaves first).
        This prompt itself is cached again -- the backend just computed it -- so it stays in the index, and
        the next request behind the same prefix still finds its owner. Returns whether the index changed."""
        if reported_cached_tokens >= self.predicted_cached_tokens * EVICTION_EVIDENCE_RATIO:
            return False
        request, backend = self.request, self.backend
        keep_blocks = int(reported_cached_tokens * request.chars_per_token) // request.block_chars
        forgotten = backend.index.truncate(request.hashes, keep_blocks)
        if forgotten:
            backend.publisher.corrected(backend, request.hashes, keep_blocks)
        record(backend, request.hashes)
        return forgotten > 0

    def found_prefix(self, reported_cached_tokens: int) -> bool | None:
        """Whether a request routed for a prefix the fleet holds (a conversation's next turn, a question behind a
        cached document) found it where it went: at least half the tokens predicted there, as `learn` judges
        eviction. A spill left the deepest holder, so it did not. None for a request not routed for a prefix."""
        route = self.decision.route
        if route is Route.SPILL:
            return False
        if route is not Route.PREFIX:
            return None
        return reported_cached_tokens >= self.predicted_cached_tokens * EVICTION_EVIDENCE_RATIO

    def unrecord(self) -> None:
        """The request never reached the engine, or the engine rejected it (4xx/5xx): forget the part of its
        prompt the index recorded at decision time, so later requests behind it are not sent here for a hit that
        is not cached (and one rejected giant prompt does not evict the conversations that are)."""
        backend, hashes, keep_blocks = self.backend, self.request.hashes, self.decision.matched_blocks
        if backend.index.truncate(hashes, keep_blocks):
            backend.publisher.corrected(backend, hashes, keep_blocks)

    def finish(self) -> None:
        """Release what was reserved. Without a first byte (failed, timed out, abandoned) the request's time says
        nothing about the backend's prefill rate, so its prefill is dropped, not learned from."""
        if not self._finished:
            self._finished = True
            if self._prefilling:
                self._prefilling = False
                self.backend.prefill_dropped(self._pending_prefill)
            if self._probe:
                self.backend.outlier.probe_ended()
            self.backend.release(self.request.hashes)


class Router:
    def __init__(self, pool: Pool, config: RoutingConfig, default_model: str | None = None) -> None:
        self.pool = pool
        self.config = config
        self.policy = make_policy(config.policy, config.policy_config)
        self.default_model = default_model
        # Kept only for a policy that reads them: under the baselines a key changes nothing.
        self.sessions = Sessions(config.session_max_keys, config.session_ttl_s) \
            if config.policy_config.follows_sessions else None
        self._seeds: dict[str, int] = {}  # model name -> its block-hash seed, hashed once per name
        self._hashes = PrefixHashes(config.block_chars)

    def seed_of(self, model: str) -> int:
        """The block-hash seed of `model` (hashing.py `namespace_seed`), computed once per name. Names come only
        from resolved models, so the dict is as big as the set of models ever served; it is emptied past
        `MAX_SEEDS` all the same, against adapters loaded and unloaded without end."""
        seed = self._seeds.get(model)
        if seed is None:
            if len(self._seeds) >= MAX_SEEDS:
                self._seeds.clear()
            seed = self._seeds[model] = namespace_seed(model)
        return seed

    def routing_request(self, text: str, model: str | None = None, session: str | None = None) -> RoutingRequest:
        """The request as policies see it; `session` is the client's session key, if it sent one."""
        seed = self.seed_of(model) if model else ROOT_SEED
        return RoutingRequest(self._hashes.of(text, seed), len(text),
                              self.config.block_chars, self.config.chars_per_token,
                              None if session is None or self.sessions is None else key_hash(session))

    def resolve_model(self, requested: str | None, lora_path: Any = None) -> str:
        return self.pool.resolve_model(requested, self.default_model, lora_path)

    def place(self, model: str, request: RoutingRequest, avoid: Sequence[Backend] = ()) -> Placement:
        """Choose a backend for `request`, not one in `avoid` unless no other is left, and reserve it; raises
        NoHealthyBackend when none is healthy."""
        candidates = self.pool.serving(model, exclude=avoid) or self.pool.candidates(model)
        key, sessions = request.session, self.sessions
        if key is None or sessions is None or not request.hashes:  # no full block: nothing for a key to vouch for
            return self._reserve(self.policy.choose(candidates, request), request)
        request = request._replace(last_visit=sessions.last_visit(key))
        decision = self.policy.choose(candidates, request)
        visit = Visit.of(decision.backend, len(request.hashes), request.hashes[-1])
        sessions.visited(key, visit)  # the key follows its request
        decision.backend.publisher.session_visited(decision.backend, key, visit.blocks, visit.last_hash)
        return self._reserve(decision, request)

    def place_least_loaded(self, model: str, request: RoutingRequest, avoid: Sequence[Backend] = ()) -> Placement:
        """As `place`, for a request that fills no prefix cache (tokenize, rerank, ...): the policy's view of the
        prompt does not matter, only the load."""
        candidates = self.pool.serving(model, exclude=avoid) or self.pool.candidates(model)
        backend = least_loaded(candidates)
        return self._reserve(Decision(backend, Route.LEAST_LOAD, backend.index.match(request.hashes)), request)

    def place_on(self, backend: Backend, request: RoutingRequest) -> Placement:
        """Reserve the one backend that can serve the request: it holds the state the request names."""
        return self._reserve(Decision(backend, Route.OWNER, backend.index.match(request.hashes)), request)

    def _reserve(self, decision: Decision, request: RoutingRequest) -> Placement:
        record(decision.backend, request.hashes)
        return Placement(decision, request)


def record(backend: Backend, hashes: Sequence[int]) -> None:
    """Record that the backend will cache this prompt, as much of it as one request may claim, and tell the
    other gateway instances when state is shared."""
    head = hashes[:backend.index.record_limit_blocks]
    backend.index.insert(head)
    backend.publisher.placed(backend, head)
