"""Routing policies: given the healthy backends that serve a request's model, pick one.

The interface is one method, `choose(backends, request) -> Decision`, called synchronously by the router between
receiving a request and forwarding it. Policies read backend state (load, prefix index) but never change it:
the router reserves load and records the prompt in the chosen backend's index right after the decision, so
concurrent requests see each other's placement.

One module per policy family; each policy takes its own frozen config dataclass (its knobs, with their defaults)
and is listed once, by name, in `gateway/routing/policies/registry.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple, Protocol

from gateway.fleet.backends import Backend


class Route(str, Enum):
    """Why a backend was chosen; sent back in `x-gateway-route` and used as a metric label."""

    PREFIX = "prefix"                # it holds the longest useful prefix
    SPILL = "spill"                  # the prefix owners were saturated; replicated onto another backend
    LEAST_LOAD = "least-load"        # no useful prefix anywhere; the least loaded backend
    IMBALANCE = "imbalance"          # the fleet was imbalanced; affinity ignored (cache_aware)
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    POWER_OF_TWO = "power-of-two"
    OWNER = "owner"                  # it holds the stored response the request continues (gateway/api/responses.py)
    SESSION = "session"              # its session key's history, beyond what its prefix index still predicts


@dataclass(frozen=True, slots=True)  # a few 100k of them live in the session map
class Visit:
    """Where a session key's last request went (gateway/routing/sessions.py): its backend; its prompt as the
    number of hashed blocks, the hash of the last one and how many of them the backend's index recorded (a request
    claims at most a quarter of an index); and how many blocks that index had evicted then."""

    backend: Backend
    blocks: int
    last_hash: int
    recorded_blocks: int
    evicted_blocks: int

    def pushed_out(self) -> int:
        """Blocks the backend's index evicted since the visit: newer content, which pushes this out in turn."""
        return self.backend.index.evicted_blocks - self.evicted_blocks


class RoutingRequest(NamedTuple):
    """What a policy knows of a request: its prompt's chained block hashes and its length, and, when the client
    sent a session key, that key's hash and where its last request went (filled in by the router, for policies
    that follow sessions)."""

    hashes: Sequence[int]
    text_chars: int
    block_chars: int
    chars_per_token: float
    session: int | None = None
    last_visit: Visit | None = None

    def match_fraction(self, blocks: int) -> float:
        return min(1.0, blocks * self.block_chars / self.text_chars) if self.text_chars else 0.0

    def tokens(self, chars: int) -> int:
        return int(chars / self.chars_per_token)

    def block_tokens(self, blocks: int) -> int:
        """Tokens in the first `blocks` hashed blocks."""
        return self.tokens(blocks * self.block_chars)

    def uncached_tokens(self, matched_blocks: int) -> int:
        """Prompt tokens left to prefill when the first `matched_blocks` are cached."""
        return max(0, self.prompt_tokens - self.block_tokens(matched_blocks))

    @property
    def prompt_tokens(self) -> int:
        return self.tokens(self.text_chars)

    def session_blocks(self, backend: Backend) -> int:
        """Blocks of this prompt that `backend` computed for the session's last request: all of that prompt when
        this one continues it (its last block hash is ours at the same place) and it went to `backend`, else 0."""
        visit = self.last_visit
        if visit is None or visit.backend is not backend or not 0 < visit.blocks <= len(self.hashes):
            return 0
        return visit.blocks if self.hashes[visit.blocks - 1] == visit.last_hash else 0

    def visit(self, backend: Backend, recorded_blocks: int) -> Visit:
        """This request as its session's last visit, to `backend`, whose index recorded its first blocks."""
        return Visit(backend, len(self.hashes), self.hashes[-1] if self.hashes else 0, recorded_blocks,
                     backend.index.evicted_blocks)


class Decision(NamedTuple):
    backend: Backend
    route: Route
    matched_blocks: int


@dataclass(frozen=True)
class PolicyConfig:
    """The knobs of a policy that has none; a policy with knobs subclasses it with its own fields."""

    @property
    def index_share(self) -> float:
        """Share of a backend's reported KV capacity its prefix index models: the whole pool, unless a policy
        leaves the engine room for running requests (prefix_aware's `index_kv_share`)."""
        return 1.0

    @property
    def follows_sessions(self) -> bool:
        """Whether the policy reads `RoutingRequest.last_visit`: only then does the router keep session keys, so
        the baselines (round_robin, cache_aware) ignore them (prefix_aware's `session_weight`)."""
        return False


class Policy(Protocol):
    name: str

    def choose(self, backends: Sequence[Backend], request: RoutingRequest) -> Decision:
        """Pick one of `backends` (never empty, all healthy and serving the request's model)."""
        ...

