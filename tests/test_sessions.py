"""Session keys: what is read as a key, where a key sends its requests under prefix_aware, and the map's bounds."""

from __future__ import annotations

import random

import pytest

from gateway.api.prompts import Endpoint, session_key
from gateway.config import build_config
from gateway.errors import ConfigError
from gateway.fleet.backends import Backend, BackendSpec
from gateway.fleet.pool import Pool
from gateway.routing.policies import Route, Visit
from gateway.routing.policies.registry import configure
from gateway.routing.router import Router, RoutingConfig
from gateway.routing.sessions import Sessions
from tests.policy_fixtures import make_backends, text

SYSTEM = text("shared agent system prompt with tool rules", 2000)  # 31 blocks
INDEX_BLOCKS = 120  # a request records at most 30 blocks: of an agent's long context, the shared system prompt


def router(policy: str = "prefix_aware", capacity_blocks: int = INDEX_BLOCKS, **knobs: float) -> Router:
    # Engines reporting the KV capacity whose 85% the index models (16 tokens a block).
    kv_tokens = round(capacity_blocks * 16 / 0.85)
    pool = Pool([BackendSpec(f"http://b{i}", model="m", capacity_tokens=kv_tokens) for i in range(3)],
                index_capacity_blocks=capacity_blocks, retry_after_s=1)
    for backend in pool.backends:
        backend.health_check_passed(success_threshold=1)
    return Router(pool, RoutingConfig(policy=policy, policy_config=configure(policy, knobs)))


def turn(session: int, rounds: int) -> str:
    return SYSTEM + "".join(text(f"session {session} tool output {r}", 1500) for r in range(rounds))


def place(subject: Router, prompt: str, key: str | None = None) -> str:
    """Place and finish a request (as after its answer); the backend's URL."""
    placement = subject.place("m", subject.routing_request(prompt, session=key))
    placement.first_byte()
    placement.finish()
    return placement.backend.url


def backend(subject: Router, url: str) -> Backend:
    return next(b for b in subject.pool.backends if b.url == url)


def other_conversations(subject: Router, home: str) -> None:
    """Every backend holds the recorded head of the system prompt, as other conversations left it; `home` also
    holds another conversation's history below it, so there a new branch would be charged."""
    head = subject.routing_request(SYSTEM).hashes[:INDEX_BLOCKS // 4]
    for each in subject.pool.backends:
        each.index.insert(head)
    backend(subject, home).index.insert(subject.routing_request(turn(99, 1)).hashes[:INDEX_BLOCKS // 4 + 20])


def test_session_key_finds_the_backend_holding_a_context_longer_than_the_index_records() -> None:
    results = {}
    for key in (None, "agent-7"):
        subject = router()
        home = place(subject, turn(7, 2), key)
        other_conversations(subject, home)
        results[key] = (home, place(subject, turn(7, 3), key))
    keyless_home, keyless_next = results[None]
    assert keyless_next != keyless_home  # the index knows only the shared head: a new conversation, to it
    keyed_home, keyed_next = results["agent-7"]
    assert keyed_next == keyed_home


def test_a_request_the_key_brought_home_is_routed_as_session() -> None:
    subject = router()
    home = place(subject, turn(7, 2), "agent-7")
    other_conversations(subject, home)
    assert subject.place("m", subject.routing_request(turn(7, 3), session="agent-7")).decision.route is Route.SESSION


def test_a_backend_that_reported_no_kv_capacity_gets_no_credit_from_a_key() -> None:
    subject = router()
    for each in subject.pool.backends:
        each.capacity_tokens = None
    home = place(subject, turn(7, 2), "agent-7")
    other_conversations(subject, home)
    placement = subject.place("m", subject.routing_request(turn(7, 3), session="agent-7"))
    assert placement.decision.route is not Route.SESSION


def test_session_key_is_not_believed_once_the_index_lost_what_it_recorded() -> None:
    decisions = {}
    for key in (None, "agent-8"):
        subject = router()
        home = place(subject, turn(8, 2), key)
        other_conversations(subject, home)
        backend(subject, home).index.clear()  # evicted there, so the engine evicted the rest too
        decisions[key] = place(subject, turn(8, 3), key)
    assert decisions[None] == decisions["agent-8"]


def test_session_key_is_not_believed_once_the_engine_has_pushed_it_out() -> None:
    decisions = {}
    for key in (None, "agent-8"):
        subject = router()
        home = place(subject, turn(8, 2), key)
        for i in range(10):  # newer content: the engine's 120 blocks of prefixes hold no longer the session's tail
            backend(subject, home).index.insert(subject.routing_request(text(f"newer traffic {i}", 1280)).hashes)
        other_conversations(subject, home)
        decisions[key] = place(subject, turn(8, 3), key)
    assert decisions[None] == decisions["agent-8"]


def test_session_key_moves_when_its_backend_is_overloaded_and_follows_the_move() -> None:
    subject = router()
    home = place(subject, turn(1, 2), "agent-1")
    other_conversations(subject, home)
    for _ in range(8):  # a long queue of prefill: waiting there costs more than recomputing the history
        backend(subject, home).reserve(20_000, ())
    moved = place(subject, turn(1, 3), "agent-1")
    assert moved != home
    key = subject.routing_request("", session="agent-1").session
    assert subject.sessions is not None and key is not None
    visit = subject.sessions.last_visit(key)
    assert visit is not None and visit.backend.url == moved


def test_session_key_never_sends_requests_to_a_backend_the_guard_rail_skips() -> None:
    subject = router()
    home = place(subject, turn(2, 2), "agent-2")
    next(b for b in subject.pool.backends if b.url == home).in_flight = 100
    assert place(subject, turn(2, 3), "agent-2") != home


def test_without_keys_decisions_are_those_of_a_gateway_that_ignores_keys() -> None:
    rng = random.Random(5)
    prompts = [turn(rng.randrange(6), rng.randrange(1, 5)) for _ in range(60)]
    following, ignoring = router(capacity_blocks=10_000), router(capacity_blocks=10_000, session_weight=0.0)
    assert following.sessions is not None and ignoring.sessions is None
    assert [place(following, p) for p in prompts] == [place(ignoring, p) for p in prompts]


def test_a_key_weighs_only_for_a_request_continuing_its_last_prompt() -> None:
    keyed, keyless = router(), router()
    for subject, key in ((keyed, "user-alice"), (keyless, None)):
        other_conversations(subject, place(subject, turn(1, 2), key))
    # The same user's other conversation: not a continuation, so the key changes nothing.
    assert place(keyed, turn(2, 2), "user-alice") == place(keyless, turn(2, 2))


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
def test_baselines_ignore_keys(policy: str) -> None:
    subject = router(policy)
    assert subject.sessions is None and subject.routing_request("x", session="agent-1").session is None


def test_session_map_forgets_the_least_recently_used_key_first() -> None:
    backend = make_backends(1)[0]
    sessions = Sessions(max_keys=2, ttl_s=60.0)
    for key in (1, 2):
        sessions.visited(key, Visit(backend, 1, key, 1, 0))
    sessions.visited(1, Visit(backend, 2, 1, 1, 0))  # key 1 used again: key 2 is now the oldest
    sessions.visited(3, Visit(backend, 1, 3, 1, 0))
    assert len(sessions) == 2 and sessions.last_visit(2) is None and sessions.last_visit(1) is not None


def test_session_map_forgets_keys_idle_longer_than_the_ttl() -> None:
    now = [0.0]
    backend = make_backends(1)[0]
    sessions = Sessions(max_keys=10, ttl_s=5.0, clock=lambda: now[0])
    sessions.visited(1, Visit(backend, 1, 1, 1, 0))
    now[0] = 4.0
    sessions.visited(2, Visit(backend, 1, 2, 1, 0))
    now[0] = 6.0
    assert sessions.last_visit(1) is None and sessions.last_visit(2) is not None
    sessions.visited(3, Visit(backend, 1, 3, 1, 0))
    assert len(sessions) == 2


def test_session_header_wins_over_prompt_cache_key_which_wins_over_user() -> None:
    body = {"prompt_cache_key": "cache-1", "user": "alice"}
    assert session_key(Endpoint.CHAT, body, "header-1") == "header-1"
    assert session_key(Endpoint.CHAT, body, None) == "cache-1"
    assert session_key(Endpoint.RESPONSES, {"user": "alice"}, None) == "alice"
    assert session_key(Endpoint.COMPLETION, {"user": 7, "prompt_cache_key": ""}, "") is None


def test_anthropic_messages_read_metadata_user_id() -> None:
    assert session_key(Endpoint.MESSAGES, {"metadata": {"user_id": "u-1"}, "user": "ignored"}, None) == "u-1"
    assert session_key(Endpoint.MESSAGES, {"metadata": "not an object"}, None) is None


def test_session_header_option_takes_a_header_name_or_nothing() -> None:
    assert build_config({}, {"session_header": "X-Agent-Session"}).session_header == "x-agent-session"
    assert build_config({}, {"session_header": ""}).session_header == ""
    with pytest.raises(ConfigError, match="session_header"):
        build_config({}, {"session_header": "bad header"})
