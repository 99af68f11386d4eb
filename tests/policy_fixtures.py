"""Hand-built backends and requests for policy tests."""

from __future__ import annotations

import itertools

from gateway.fleet.backends import Backend, BackendSpec
from gateway.routing.hashing import block_hashes
from gateway.routing.policies import RoutingRequest
from gateway.routing.prefix_index import PrefixIndex

BLOCK = 64


def make_backends(count: int, capacity_blocks: int = 10_000) -> list[Backend]:
    clock = itertools.count(1).__next__
    return [Backend(BackendSpec(f"http://b{i}"), PrefixIndex(capacity_blocks, clock), model="m", healthy=True)
            for i in range(count)]


def request(text: str) -> RoutingRequest:
    return RoutingRequest(block_hashes(text, BLOCK), len(text), BLOCK, 4.0)


def text(label: str, chars: int) -> str:
    return (label + " ") * (chars // (len(label) + 1))
