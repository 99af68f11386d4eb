"""Shared state without a store: the encoding, applying other instances' updates, the hooks, the load view, and a
store that is not there. Against a real Redis: tests/test_e2e_shared_state.py."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from gateway.fleet.backends import Backend, BackendSpec, RemoteLoad
from gateway.fleet.pool import Pool
from gateway.fleet.shared_state import (
    CORRECTED,
    DOWN,
    DOWN_VERDICT_MAX_AGE_S,
    PLACED,
    REPLACEMENT_QUIET_S,
    SESSION,
    SharedState,
    apply_update,
    backend_id,
    decode_load,
    decode_updates,
    encode_load,
    encode_update,
    encoded_size,
)
from gateway.routing.policies import PolicyConfig
from gateway.routing.policies.basic import LeastLoad
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.router import Router, RoutingConfig
from gateway.routing.sessions import Sessions
from simulator.fleet import free_port
from tests.policy_fixtures import make_backends, request, text


def healthy_pool(count: int) -> Pool:
    pool = Pool([BackendSpec(f"http://b{i}", model="m") for i in range(count)], 10_000, retry_after_s=1)
    for backend in pool.backends:
        backend.healthy = True
    return pool


def by_id(pool: Pool) -> dict[int, Backend]:
    return {backend_id(b.url): b for b in pool.backends}


def test_updates_round_trip_through_their_encoding() -> None:
    hashes = [0, 1, 2**64 - 1, 0x5EED_5EED_5EED_5EED]
    blob = (encode_update(PLACED, 7, hashes) + encode_update(CORRECTED, 2**32 - 1, hashes[2:3])
            + encode_update(DOWN, 9))
    assert list(decode_updates(blob)) == [(PLACED, 7, tuple(hashes)), (CORRECTED, 2**32 - 1, (2**64 - 1,)),
                                          (DOWN, 9, ())]
    assert len(encode_update(PLACED, 7, hashes)) == 7 + 8 * len(hashes)  # what a placement costs, in bytes


def test_the_queued_size_of_an_update_is_its_encoded_size() -> None:
    for hashes in ([], [1, 2, 3], list(range(0x10000 + 5))):  # the last longer than an update holds
        assert encoded_size(hashes) == len(encode_update(PLACED, 7, hashes))


def test_load_round_trips_through_its_encoding() -> None:
    loads = [(1, RemoteLoad(3, 2, 1500, 40)), (2, RemoteLoad())]
    assert decode_load(encode_load(42, loads)) == (42, dict(loads))


def test_a_remote_placement_lands_in_that_backends_index_only() -> None:
    pool = healthy_pool(3)
    prompt = request(text("shared system prompt", 2000))
    assert apply_update(by_id(pool), PLACED, backend_id("http://b1"), prompt.hashes, age_s=0.0)
    assert [b.index.match(prompt.hashes) for b in pool.backends] == [0, len(prompt.hashes), 0]


def test_a_remote_correction_forgets_from_the_evicted_block_on() -> None:
    pool = healthy_pool(1)
    prompt = request(text("conversation", 2000))
    backend = pool.backends[0]
    backend.index.insert(prompt.hashes)
    encoded = encode_update(CORRECTED, backend_id(backend.url), prompt.hashes[10:11])
    for kind, bid, hashes in decode_updates(encoded):
        apply_update(by_id(pool), kind, bid, hashes, age_s=0.0)
    assert backend.index.match(prompt.hashes) == 10


def test_a_fresh_down_verdict_takes_the_backend_out_an_old_one_only_clears_its_index() -> None:
    pool = healthy_pool(2)
    prompt = request(text("p", 640))
    for backend in pool.backends:
        backend.index.insert(prompt.hashes)
    fresh, old = pool.backends
    apply_update(by_id(pool), DOWN, backend_id(fresh.url), (), age_s=0.1)
    apply_update(by_id(pool), DOWN, backend_id(old.url), (), age_s=DOWN_VERDICT_MAX_AGE_S + 1)
    assert (fresh.healthy, fresh.index.size_blocks) == (False, 0)
    assert (old.healthy, old.index.size_blocks) == (True, 0)


def test_an_update_for_a_backend_this_instance_does_not_have_or_of_an_unknown_kind_is_ignored() -> None:
    pool = healthy_pool(1)
    backend = pool.backends[0]
    backend.index.insert([1, 2])
    assert not apply_update(by_id(pool), PLACED, backend_id("http://elsewhere"), [3, 4], age_s=0.0)
    assert not apply_update(by_id(pool), 99, backend_id(backend.url), (), age_s=0.0)
    assert backend.healthy and backend.index.size_blocks == 2


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []

    def placed(self, backend: Backend, hashes: Sequence[int]) -> None:
        self.calls.append(("placed", backend.url, len(hashes)))

    def corrected(self, backend: Backend, hashes: Sequence[int], keep_blocks: int) -> None:
        self.calls.append(("corrected", backend.url, keep_blocks))

    def marked_down(self, backend: Backend) -> None:
        self.calls.append(("down", backend.url, 0))

    def cleared(self, backend: Backend) -> None:
        self.calls.append(("cleared", backend.url, 0))

    def session_visited(self, backend: Backend, key: int, blocks: int, last_hash: int) -> None:
        self.calls.append(("session", backend.url, blocks))


def test_the_router_publishes_placements_corrections_and_down_verdicts() -> None:
    pool = healthy_pool(2)
    recorder = Recorder()
    for backend in pool.backends:
        backend.publisher = recorder
    router = Router(pool, RoutingConfig(policy="prefix_aware"))
    prompt = router.routing_request(text("a long system prompt", 4000))
    placement = router.place("m", prompt)
    placement.first_byte()  # its prefill done: the same prompt returns to its holder, not a copy on an empty cache
    url, blocks = placement.backend.url, len(prompt.hashes)
    router.place("m", prompt).learn(reported_cached_tokens=0)  # the backend had evicted it all
    longer = router.routing_request(text("a long system prompt", 4000) + " and more" * 100)
    never_sent = router.place("m", longer)
    never_sent.unrecord()
    placement.backend.health_check_failed("test", failure_threshold=1)
    placement.backend.health_check_failed("again", failure_threshold=1)  # already down: nothing new to tell
    assert recorder.calls == [("placed", url, blocks), ("placed", url, blocks), ("corrected", url, 0),
                              ("placed", url, blocks), ("placed", url, len(longer.hashes)),
                              ("corrected", url, blocks), ("down", url, 0)]


def test_a_session_key_is_published_with_its_backend_and_learnt_by_the_other_instances() -> None:
    pool = healthy_pool(2)
    recorder = Recorder()
    for backend in pool.backends:
        backend.publisher = recorder
    router = Router(pool, RoutingConfig(policy="prefix_aware"))
    prompt = router.routing_request(text("an agent's session", 2000), session="agent-1")
    placement = router.place("m", prompt)
    assert ("session", placement.backend.url, len(prompt.hashes)) in recorder.calls
    other, sessions = healthy_pool(2), Sessions(max_keys=10, ttl_s=60.0)
    assert prompt.session is not None
    update = (prompt.session, len(prompt.hashes), prompt.hashes[-1])
    assert apply_update(by_id(other), SESSION, backend_id(placement.backend.url), update, 0.0, sessions)
    visit = sessions.last_visit(prompt.session)
    assert visit is not None and visit.backend.url == placement.backend.url and visit.blocks == len(prompt.hashes)
    # An instance that keeps no keys (a baseline policy) ignores them.
    assert not apply_update(by_id(other), SESSION, backend_id(placement.backend.url), update, 0.0, None)


def test_a_replayed_session_visit_older_than_the_ttl_is_skipped() -> None:
    pool, sessions = healthy_pool(1), Sessions(max_keys=10, ttl_s=60.0)
    target = backend_id(pool.backends[0].url)
    # Remembered now, it would live a whole TTL more than the key's last request allows.
    assert not apply_update(by_id(pool), SESSION, target, (1, 40, 99), 61.0, sessions)
    assert apply_update(by_id(pool), SESSION, target, (2, 40, 99), 59.0, sessions)
    assert sessions.last_visit(1) is None and sessions.last_visit(2) is not None


def test_a_session_visit_from_another_instance_records_what_one_request_may_record() -> None:
    pool, sessions = healthy_pool(1), Sessions(max_keys=10, ttl_s=60.0)
    apply_update(by_id(pool), SESSION, backend_id(pool.backends[0].url), (1, 5000, 99), 0.0, sessions)
    visit = sessions.last_visit(1)
    assert visit is not None and visit.recorded_blocks == pool.backends[0].index.record_limit_blocks == 2500


def test_a_prompt_placed_again_is_news_only_after_a_quiet_interval_or_something_forgotten() -> None:
    pool = healthy_pool(2)
    shared = SharedState(f"redis://127.0.0.1:{free_port()}/0", pool, CollectorRegistry())
    first, second = pool.backends
    prompt = [11, 12, 13]

    def published() -> list[tuple[str, int]]:
        queued = [(url, hashes[-1]) for kind, url, hashes in shared._pending if kind == PLACED]
        shared._pending.clear()
        return queued

    shared._end_quiet_interval(100.0)
    shared.placed(first, prompt)
    shared.placed(first, prompt)  # still in use: the others learn that at the end of the interval
    shared.placed(second, prompt)  # a copy elsewhere is news
    shared.placed(first, prompt[:2])  # so is a prompt that ends elsewhere in the tree
    shared.placed(first, [])  # no full block: nothing to tell
    assert published() == [(first.url, 13), (second.url, 13), (first.url, 12)]
    shared._end_quiet_interval(100.0 + REPLACEMENT_QUIET_S / 2)
    shared.placed(first, prompt)
    assert published() == []
    shared._end_quiet_interval(100.0 + REPLACEMENT_QUIET_S)
    shared.placed(first, prompt)
    assert published() == [(first.url, 13)]
    shared.corrected(second, prompt, keep_blocks=1)  # another prompt's correction may have cut this one too
    shared.placed(first, prompt)
    assert published() == [(first.url, 13)]
    # So may another instance's: applying it makes the prompt news again as well.
    blob = encode_update(CORRECTED, backend_id(first.url), prompt[1:2])
    asyncio.run(shared._apply_entries([(b"1-0", {b"i": b"other", b"t": repr(time.time()).encode(), b"b": blob})],
                                      live=False))
    shared.placed(first, prompt)
    assert published() == [(first.url, 13)]


def test_a_verdict_from_another_instance_is_not_published_again() -> None:
    backend = healthy_pool(1).backends[0]
    recorder = Recorder()
    backend.publisher = recorder
    backend.take_out("another instance marked it down")
    assert not backend.healthy and recorder.calls == []


def test_policies_count_the_load_other_instances_put_on_a_backend() -> None:
    backends = make_backends(2)
    backends[0].in_flight, backends[1].remote = 1, RemoteLoad(in_flight=3)
    assert LeastLoad(PolicyConfig()).choose(backends, request("x")).backend is backends[0]


def test_an_index_rebuilt_from_its_paths_matches_like_the_original() -> None:
    rng = random.Random(3)
    original = PrefixIndex(300)
    prompts = [[rng.randrange(4) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
    chained = [[hash(tuple(p[:i + 1])) & (2**64 - 1) for i in range(len(p))] for p in prompts]
    for hashes in chained:
        original.insert(hashes)
    rebuilt = PrefixIndex(300)
    for path in original.paths():
        rebuilt.insert(path)
    rebuilt.check_invariants()
    assert [rebuilt.match(h) for h in chained] == [original.match(h) for h in chained]
    assert original.paths() == rebuilt.paths()  # the same LRU order


def test_without_a_store_routing_goes_on_and_updates_are_dropped_and_counted() -> None:
    pool = healthy_pool(2)
    shared = SharedState(f"redis://127.0.0.1:{free_port()}/0", pool, CollectorRegistry())

    async def run() -> dict[str, object]:
        started = time.monotonic()
        await shared.start()
        assert time.monotonic() - started < 2.0
        router = Router(pool, RoutingConfig())
        for i in range(5):
            router.place("m", router.routing_request(text(f"prompt {i}", 1000))).finish()
        await asyncio.sleep(0.3)
        described = shared.describe()
        await shared.stop()
        return described

    described = asyncio.run(run())
    assert described["up"] is False and described["warmed_updates"] is None
    assert described["dropped_updates"] == 5 and described["published_updates"] == 0
    assert "ConnectionError" in str(described["error"])


def test_a_backend_added_at_run_time_publishes_and_receives_updates() -> None:
    pool = healthy_pool(1)
    shared = SharedState(f"redis://127.0.0.1:{free_port()}/0", pool, CollectorRegistry())

    async def run() -> Backend:
        await shared.start()
        added = pool.add(BackendSpec("http://b9", model="m"))
        await shared.stop()
        return added

    added = asyncio.run(run())
    assert added.publisher is shared
    added.restarted("a test")  # published as a CLEARED update: appended, never raises
    assert backend_id(added.url) in shared._backends()
    pool.remove(added)
    assert backend_id(added.url) not in shared._backends()
