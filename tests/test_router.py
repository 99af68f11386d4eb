"""The choose and record steps around the policy: what a request may teach a backend's prefix index."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from gateway.api.prompts import Endpoint
from gateway.api.relay import Outcome
from gateway.api.usage import Usage
from gateway.app import Exchange, Gateway
from gateway.config import GatewayConfig
from gateway.fleet.backends import BackendSpec
from gateway.fleet.pool import Pool
from gateway.routing.policies import Decision, Route
from gateway.routing.prefix_index import MAX_RECORD_SHARE
from gateway.routing.router import Placement, Router
from tests.policy_fixtures import text

SYSTEM = text("You are a helpful assistant.", 1000)


def gateway() -> Gateway:
    gateway = Gateway(GatewayConfig(backends=(BackendSpec("http://b0", model="m"),)))
    gateway.pool.backends[0].health_check_passed(success_threshold=1)
    return gateway


def answer(gateway: Gateway, prompt: str, status: int) -> None:
    routing = gateway.router.routing_request(prompt)
    placement = gateway.router.place("m", routing)
    exchange = Exchange(Endpoint.CHAT, "POST", "/v1/chat/completions", {}, b"{}", "m", False, "id", time.monotonic())
    gateway.record(placement, exchange, Outcome(status=status))


def test_a_prompt_the_backend_rejected_is_forgotten_by_its_index() -> None:
    for status in (400, 413, 500, 503):
        subject = gateway()
        index = subject.pool.backends[0].index
        answer(subject, SYSTEM, 200)
        held = index.size_blocks
        answer(subject, SYSTEM + text("a question far too long", 4000), status)
        assert index.size_blocks == held  # the shared head it matched stays, its own part goes


def test_a_prompt_the_backend_answered_stays_in_its_index() -> None:
    subject = gateway()
    prompt = SYSTEM + text("a question", 4000)
    answer(subject, prompt, 200)
    routing = subject.router.routing_request(prompt)
    assert subject.pool.backends[0].index.match(routing.hashes) == len(routing.hashes)


def test_one_request_claims_at_most_a_quarter_of_an_index() -> None:
    pool = Pool([BackendSpec("http://b0", model="m")], index_capacity_blocks=100, retry_after_s=1)
    pool.backends[0].health_check_passed(success_threshold=1)
    router = Router(pool, GatewayConfig().routing)
    conversations = [router.routing_request(text(f"conversation {i}", 20 * 64)) for i in range(3)]
    for conversation in conversations:
        router.place("m", conversation).finish()
    giant = router.routing_request(text("a giant prompt", 1000 * 64))
    router.place("m", giant).finish()
    index = pool.backends[0].index
    assert index.match(giant.hashes) == int(100 * MAX_RECORD_SHARE)  # its head, which is what matches
    assert all(index.match(c.hashes) == len(c.hashes) for c in conversations)
    index.check_invariants()


def prefix_turns(subject: Gateway) -> dict[str, float]:
    families = text_string_to_metric_families(subject.metrics.render().decode())
    return {sample.labels["found"]: sample.value for family in families for sample in family.samples
            if sample.name == "gateway_prefix_turns_total"}


def answered(subject: Gateway, prompt: str, cached_tokens: int) -> None:
    placement = subject.router.place("m", subject.router.routing_request(prompt))
    exchange = Exchange(Endpoint.CHAT, "POST", "/v1/chat/completions", {}, b"{}", "m", False, "id", time.monotonic())
    subject.record(placement, exchange, Outcome(status=200, usage=Usage(len(prompt) // 4, cached_tokens)))


def test_turns_routed_for_a_held_history_count_whether_their_backend_still_had_it() -> None:
    subject = gateway()
    history = SYSTEM + text("user: my order is late", 800)
    answered(subject, history, 0)  # a first prompt is routed for nothing held: not a turn
    assert prefix_turns(subject) == {}
    answered(subject, history + text("next question", 200), 400)  # found its 450-token history
    answered(subject, history + text("another question", 200), 0)  # the engine had evicted it
    assert prefix_turns(subject) == {"true": 1.0, "false": 1.0}


def test_a_spilled_turn_did_not_find_its_prefix_and_a_cold_one_is_not_a_turn() -> None:
    subject = gateway()
    backend, routing = subject.pool.backends[0], subject.router.routing_request(SYSTEM)
    assert Placement(Decision(backend, Route.SPILL, 3), routing).found_prefix(10_000) is False
    assert Placement(Decision(backend, Route.LEAST_LOAD, 0), routing).found_prefix(0) is None
