"""prefix_aware on hand-built situations: the behaviours its module docstring promises."""

import time

import pytest

from gateway.fleet.backends import Backend, LoadSignals
from gateway.routing.policies import Route
from gateway.routing.policies.prefix_aware import FULL_AFFINITY_FILL, PrefixAware, PrefixAwareConfig
from gateway.routing.router import Placement
from tests.fake_clock import FakeClock
from tests.policy_fixtures import make_backends, request, text

SYSTEM = text("shared system prompt", 4000)
SHORT_SYSTEM = text("short system prompt", 600)  # holding it saves little, so load and history decide


def policy(**overrides: float) -> PrefixAware:
    settings = {"cache_threshold": 0.3, "balance_abs_threshold": 64, "balance_rel_threshold": 1.5,
                "decode_weight_tokens": 4.0, "affinity_weight": 4.0}
    settings.update(overrides)
    return PrefixAware(PrefixAwareConfig(**settings))  # type: ignore[arg-type]


def test_conversation_follows_its_history_not_the_shared_system_prompt() -> None:
    backends = make_backends(3)
    for backend in backends:
        backend.index.insert(request(SYSTEM).hashes)
    turn1 = SYSTEM + text("user: my order is late", 800)
    backends[2].index.insert(request(turn1).hashes)
    decision = policy().choose(backends, request(turn1 + text("assistant: sorry user: where is it", 400)))
    assert decision.backend is backends[2] and decision.route is Route.PREFIX


def test_conversations_behind_a_short_shared_prompt_held_by_one_backend_spread() -> None:
    backends = make_backends(3)
    backends[0].index.insert(request(SHORT_SYSTEM).hashes)
    chooser = policy()
    chosen = set()
    for i in range(6):
        prompt = request(SHORT_SYSTEM + text(f"distinct question {i}", 1200))
        chosen.add(Placement(chooser.choose(backends, prompt), prompt).backend.url)  # reserved, as under load
    assert chosen == {b.url for b in backends}


def test_new_conversations_behind_a_shared_system_prompt_spread() -> None:
    backends = make_backends(3)
    for backend in backends:
        backend.index.insert(request(SYSTEM).hashes)
    chooser = policy()
    chosen = []
    for i in range(6):
        placement = Placement(chooser.choose(backends, request(SYSTEM + text(f"user {i} asks", 400))),
                              request(SYSTEM + text(f"user {i} asks", 400)))
        chosen.append(placement.backend.url)  # stays reserved: in flight, as under load
    assert set(chosen) == {b.url for b in backends}


def fill_with_other_prefixes(backends: list[Backend]) -> None:
    for number, backend in enumerate(backends):
        start = 1_000_000 * (number + 1)
        backend.index.insert(list(range(start, start + backend.index.capacity_blocks)))


def test_hot_prefix_spills_when_its_owner_saturates_and_stays_otherwise() -> None:
    backends = make_backends(3, capacity_blocks=400)
    fill_with_other_prefixes(backends[1:])  # a copy elsewhere would evict other prefixes
    hot = text("hot tenant prompt", 6000)
    backends[0].index.insert(request(hot).hashes)
    chooser = policy()
    backends[0].backlog.add(3000, time.monotonic())  # queued: under 4x the 1,500 tokens it saves, sticky
    assert chooser.choose(backends, request(hot + "q1")).backend is backends[0]
    backends[0].backlog.add(9000, time.monotonic())  # saturated: replicate elsewhere
    spilled = chooser.choose(backends, request(hot + "q2"))
    assert spilled.backend is not backends[0] and spilled.route is Route.SPILL
    spilled.backend.index.insert(request(hot + "q2").hashes)
    # Two owners now: the less loaded one takes the next request, with affinity.
    again = chooser.choose(backends, request(hot + "q3"))
    assert again.backend is spilled.backend and again.route is Route.PREFIX


def test_hot_prefix_is_copied_sooner_onto_a_backend_with_room_to_spare() -> None:
    backends = make_backends(3, capacity_blocks=400)
    hot = text("hot tenant prompt", 6000)
    backends[0].index.insert(request(hot).hashes)
    # A copy fills an empty cache to a quarter: charged ~1.9 times the 1,500 tokens it saves, not 4 times.
    backends[0].backlog.add(4000, time.monotonic())
    decision = policy().choose(backends, request(hot + "q1"))
    assert decision.backend is not backends[0] and decision.route is Route.SPILL


def test_a_copy_costs_its_prefill_alone_on_an_empty_cache_and_the_whole_weight_from_three_quarters_full() -> None:
    (backend,) = make_backends(1, capacity_blocks=400)
    prompt = request(text("a new prompt", 2600))
    blocks = len(prompt.hashes)  # a tenth of the cache
    assert policy().affinity(backend, 0, prompt) == pytest.approx(1 + 3 * blocks / 400 / FULL_AFFINITY_FILL)
    backend.index.insert(list(range(1, 151 - blocks)))  # with the prompt, three eighths full: half the eviction
    assert policy().affinity(backend, 0, prompt) == pytest.approx(2.5)
    backend.index.insert(list(range(1000, 1150)))  # with the prompt, three quarters full
    assert policy().affinity(backend, 0, prompt) == pytest.approx(4.0)
    backend.index.insert(list(range(2000, 2100)))  # full: nothing more
    assert policy().affinity(backend, 0, prompt) == pytest.approx(4.0)


def test_conversations_spread_over_empty_caches_though_one_backend_holds_the_system_prompt() -> None:
    # Issue #20: histories that will fill the fleet must be partitioned while the caches are still empty; piling
    # the first conversations onto the system prompt's holder overflows its cache a few turns later.
    # Copying the system prompt onto an empty backend costs its prefill once, not four times (it evicts nothing).
    backends = make_backends(4, capacity_blocks=1000)
    system = text("tight system prompt", 1200)
    backends[0].index.insert(request(system).hashes)
    chooser = policy()
    counts = {b.url: 0 for b in backends}
    for i in range(16):  # a burst of first turns: each stays reserved, in flight
        prompt = request(system + text(f"user {i} opens a conversation", 300))
        counts[Placement(chooser.choose(backends, prompt), prompt).backend.url] += 1
    assert min(counts.values()) >= 2, counts  # with a full cache's weight everywhere: 13, 1, 1, 1


def test_new_conversation_leaves_a_nearly_full_cache_for_an_empty_one_despite_the_system_prompt() -> None:
    # Issue #20 at light load: conversations arrive one by one, and their histories will fill the cache they
    # settle in. A nearly full cache evicts live histories to take one more; an empty one only prefills.
    backends = make_backends(2, capacity_blocks=400)
    for i in range(6):
        backends[0].index.insert(request(SYSTEM + text(f"history {i}", 3500)).hashes)
    assert backends[0].index.size_blocks > 0.85 * backends[0].index.capacity_blocks
    decision = policy().choose(backends, request(SYSTEM + text("a new user", 400)))
    assert decision.backend is backends[1]


def test_cold_prefixes_spread_to_the_emptiest_backend_instead_of_the_first() -> None:
    backends = make_backends(3, capacity_blocks=1000)
    backends[0].index.insert(list(range(1, 500)))
    backends[1].index.insert(list(range(1000, 1200)))
    decision = policy().choose(backends, request(text("brand new prefix", 3000)))
    assert decision.backend is backends[2] and decision.route is Route.LEAST_LOAD


def test_fresh_backend_metrics_count_but_stale_ones_are_ignored() -> None:
    backends = make_backends(2)
    cold = request(text("cold", 2000))
    backends[0].signals = LoadSignals(queued_requests=30, running_requests=5, kv_usage=0.5,
                                      read_at_s=time.monotonic())
    chooser = policy(metrics_max_age_s=2.0)
    assert all(chooser.choose(backends, cold).backend is backends[1] for _ in range(4))
    backends[0].signals = LoadSignals(queued_requests=30, running_requests=5, kv_usage=0.5,
                                      read_at_s=time.monotonic() - 10)
    assert {chooser.choose(backends, cold).backend.url for _ in range(4)} == {b.url for b in backends}


def test_overloaded_owner_is_skipped_by_the_guard_rail_but_affinity_survives() -> None:
    backends = make_backends(3)
    prompt = text("popular", 4000)
    backends[0].index.insert(request(prompt).hashes)
    backends[1].index.insert(request(prompt[:2400]).hashes)  # a shorter part of it
    backends[0].in_flight = 100
    decision = policy().choose(backends, request(prompt + "q"))
    assert decision.backend is backends[1] and decision.route is Route.PREFIX


def test_reported_cached_tokens_far_below_prediction_correct_the_index() -> None:
    backends = make_backends(1)
    document = text("evicted later", 4000)
    prompt, sibling = request(document + text("question a", 200)), request(document + text("question b", 200))
    index = backends[0].index
    index.insert(sibling.hashes)
    index.insert(prompt.hashes)
    placement = Placement(policy().choose(backends, prompt), prompt)
    assert placement.predicted_cached_tokens > 900
    assert not placement.learn(reported_cached_tokens=placement.predicted_cached_tokens - 20)  # tokenizer noise
    assert placement.learn(reported_cached_tokens=256)  # the backend had kept only the head
    assert index.match(sibling.hashes) < len(sibling.hashes)  # evicted with the document's tail
    assert index.match(prompt.hashes) == len(prompt.hashes)  # recomputed, so cached again: the owner stays
    index.check_invariants()


def test_running_requests_pin_their_distinct_prompt_blocks_once() -> None:
    backend = make_backends(1)[0]
    first, second = request(SYSTEM + text("user a", 800)), request(SYSTEM + text("user b", 800))
    shared = len(request(SYSTEM).hashes)
    one, two = (Placement(policy().choose([backend], r), r) for r in (first, second))
    assert backend.active_blocks == len(first.hashes) + len(second.hashes) - shared
    one.finish()
    two.finish()
    assert backend.active_blocks == 0 and backend.in_flight == 0


def test_new_conversation_settles_where_the_least_conversation_memory_runs() -> None:
    backends = make_backends(2)
    backends[0].index.insert(request(SHORT_SYSTEM).hashes)
    for i in range(8):  # long conversations running on backend 0, past their prefill
        history = request(SHORT_SYSTEM + text(f"long history {i}", 6000))
        Placement(policy().choose(backends[:1], history), history).first_byte()
    decision = policy().choose(backends, request(SHORT_SYSTEM + text("new user", 400)))
    assert decision.backend is backends[1]


def hold_idle_conversations(backend: Backend) -> None:
    """Eight long conversations between turns: their histories fill `backend`'s cache, nothing runs."""
    for i in range(8):
        backend.index.insert(request(SHORT_SYSTEM + text(f"long history {i}", 6000)).hashes)


def test_new_conversation_settles_where_the_least_history_is_held_between_turns() -> None:
    backends = make_backends(2)
    hold_idle_conversations(backends[0])
    decision = policy().choose(backends, request(SHORT_SYSTEM + text("new user", 400)))
    assert decision.backend is backends[1]


def test_a_conversation_stays_with_its_history_however_much_its_backend_holds() -> None:
    backends = make_backends(2)
    backends[1].index.insert(request(SHORT_SYSTEM).hashes)
    hold_idle_conversations(backends[0])
    mine = SHORT_SYSTEM + text("my short history", 800)
    backends[0].index.insert(request(mine).hashes)
    decision = policy().choose(backends, request(mine + text("my next question", 400)))
    assert decision.backend is backends[0] and decision.route is Route.PREFIX


def test_engine_queue_we_sent_ourselves_is_not_counted_twice() -> None:
    backends = make_backends(2)
    history = SYSTEM + text("user: a long conversation", 6000)
    backends[0].index.insert(request(history).hashes)
    chooser = policy()
    for i in range(4):  # our own queued follow-ups: mostly cached, a short question each to prefill
        follow_up = request(history + text(f"question {i}", 200))
        Placement(chooser.choose(backends[:1], follow_up), follow_up)
    backends[0].signals = LoadSignals(queued_requests=4, running_requests=0, kv_usage=0.5,
                                      read_at_s=time.monotonic(), ours_prefilling=backends[0].prefilling)
    assert chooser.choose(backends, request(history + text("next", 200))).backend is backends[0]


def sent(backends: list[Backend], prompt: str) -> Placement:
    """`prompt` routed among `backends` by prefix_aware and reserved there, as the router does."""
    routed = request(prompt)
    return Placement(policy().choose(backends, routed), routed)


def teach_prefill_rate(backend: Backend, clock: FakeClock, tokens_per_s: float) -> None:
    """Prefills of 1,000 tokens, one after another, until the backend's rate is learned."""
    while backend.backlog.tokens_per_s is None:
        placement = sent([backend], text("warm-up", 4000))
        clock.now_s += placement.prefill_tokens / tokens_per_s
        placement.first_byte()
        placement.finish()


def test_newcomer_joins_the_backend_whose_prefill_is_nearly_done(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(1000.0)  # the backends' prefill backlogs and the policy read the same clock
    monkeypatch.setattr(time, "monotonic", clock)
    backends = make_backends(2)
    for backend in backends:
        teach_prefill_rate(backend, clock, tokens_per_s=4000)
    for i in range(2):  # backend 0 also runs two more requests: fewer running would favour backend 1
        sent(backends[:1], text(f"running {i}", 1600)).first_byte()
    sent(backends[:1], text("early", 4000))
    clock.now_s += 0.2  # 800 of its 1,000 tokens are done by now
    sent(backends[1:], text("late", 4000))
    assert policy().choose(backends, request(text("newcomer", 4000))).backend is backends[0]


def test_engine_queue_counted_at_scrape_time_forgets_our_requests_finished_since() -> None:
    backends = make_backends(2)
    backends[0].signals = LoadSignals(queued_requests=3, running_requests=0, kv_usage=0.1,
                                      read_at_s=time.monotonic(), ours_prefilling=3)  # ours, finished since
    cold = request(text("cold", 2000))
    chooser = policy()
    assert chooser.cost(backends[0], 0, cold) == chooser.cost(backends[1], 0, cold)


def test_a_request_that_never_reached_its_backend_is_forgotten_by_its_index() -> None:
    backend = make_backends(1)[0]
    held, failed = request(SYSTEM), request(SYSTEM + text("question", 800))
    backend.index.insert(held.hashes)
    placement = Placement(policy().choose([backend], failed), failed)
    backend.index.insert(failed.hashes)  # as Router.place records it
    placement.finish()
    placement.unrecord()  # its connection broke before the engine saw it
    assert backend.index.match(failed.hashes) == len(held.hashes)
