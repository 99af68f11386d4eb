from gateway.fleet.pool import Pool
from gateway.routing.policies import PolicyConfig, Route
from gateway.routing.policies.basic import LeastLoad, PowerOfTwo, Random, RoundRobin, SeededConfig
from gateway.routing.policies.cache_aware import CacheAware, CacheAwareConfig
from gateway.routing.router import Router, RoutingConfig
from tests.policy_fixtures import make_backends, request, text


def test_round_robin_cycles_and_reports_the_match_of_its_pick() -> None:
    backends = make_backends(3)
    prompt = request(text("p", 640))
    backends[1].index.insert(prompt.hashes)
    policy = RoundRobin(PolicyConfig())
    picks = [policy.choose(backends, prompt) for _ in range(6)]
    assert [d.backend.url for d in picks] == ["http://b0", "http://b1", "http://b2"] * 2
    assert [d.matched_blocks for d in picks[:3]] == [0, 10, 0]
    assert {d.route for d in picks} == {Route.ROUND_ROBIN}


def test_least_load_picks_the_idlest_and_spreads_ties() -> None:
    backends = make_backends(3)
    backends[0].in_flight = 5
    policy = LeastLoad(PolicyConfig())
    picks = {policy.choose(backends, request("x")).backend.url for _ in range(4)}
    assert picks == {"http://b1", "http://b2"}


def test_power_of_two_never_picks_the_busiest_of_two() -> None:
    backends = make_backends(2)
    backends[0].in_flight = 9
    policy = PowerOfTwo(SeededConfig())
    assert {policy.choose(backends, request("x")).backend.url for _ in range(20)} == {"http://b1"}


def test_random_is_seeded() -> None:
    backends = make_backends(4)
    first = [Random(SeededConfig(seed=3)).choose(backends, request("x")).backend.url for _ in range(1)]
    assert first == [Random(SeededConfig(seed=3)).choose(backends, request("x")).backend.url]


def cache_aware() -> CacheAware:
    return CacheAware(CacheAwareConfig(cache_threshold=0.3, balance_abs_threshold=64, balance_rel_threshold=1.5))


def test_cache_aware_follows_a_match_above_the_threshold() -> None:
    backends = make_backends(3)
    shared = text("system", 3200)
    backends[2].index.insert(request(shared + "old question").hashes)
    decision = cache_aware().choose(backends, request(shared + "new question"))
    assert decision.backend is backends[2] and decision.route is Route.PREFIX


def test_cache_aware_ignores_a_match_below_the_threshold_and_ties_go_to_the_first() -> None:
    backends = make_backends(3)
    shared = text("sys", 640)
    backends[2].index.insert(request(shared).hashes)
    decision = cache_aware().choose(backends, request(shared + text("long unique question", 3000)))
    assert decision.backend is backends[0] and decision.route is Route.LEAST_LOAD


def test_cache_aware_pins_a_shared_system_prompt_to_its_first_owner() -> None:
    """The weakness we keep on purpose: everyone sharing a >30% system prompt goes to its first owner."""
    backends = make_backends(3)
    shared = text("system", 3200)
    backends[1].index.insert(request(shared + "a").hashes)
    backends[0].index.insert(request(shared + "b").hashes)
    for backend in backends:
        backend.in_flight = 0
    backends[1].in_flight = 60  # busy, but not past the imbalance gate of 64
    decision = cache_aware().choose(backends, request(shared + "c"))
    assert decision.backend is backends[1]


def test_cache_aware_imbalance_gate_throws_affinity_away() -> None:
    backends = make_backends(2)
    shared = text("system", 3200)
    backends[0].index.insert(request(shared).hashes)
    backends[0].in_flight, backends[1].in_flight = 100, 10
    decision = cache_aware().choose(backends, request(shared + "q"))
    assert decision.backend is backends[1] and decision.route is Route.IMBALANCE


def test_least_loaded_placement_ignores_where_the_prompt_is_cached() -> None:
    backends = make_backends(2)
    router = Router(Pool([], 1, 1), RoutingConfig())
    router.pool.backends = backends
    prompt = request(text("shared", 640))
    backends[0].index.insert(prompt.hashes)
    backends[0].in_flight = 3
    placement = router.place_least_loaded("m", prompt)
    assert placement.backend is backends[1] and placement.decision.route is Route.LEAST_LOAD
    placement.finish()


def test_placement_on_an_owner_reserves_it_whatever_the_policy_would_pick() -> None:
    backends = make_backends(3)
    router = Router(Pool([], 1, 1), RoutingConfig(policy="round_robin", policy_config=PolicyConfig()))
    router.pool.backends = backends
    placement = router.place_on(backends[2], request("follow-up"))
    assert placement.backend is backends[2] and placement.decision.route is Route.OWNER
    assert backends[2].in_flight == 1
    placement.finish()
    assert backends[2].in_flight == 0
