"""The map of stored responses to the backends that hold them: bounded, aged, forgettable; and which backend a
request naming one goes to."""

import asyncio
from typing import cast

import pytest

from gateway.api.responses import ResponseOwners, StoredResponses, response_id_of
from gateway.errors import StoredResponseUnavailable
from gateway.fleet.backends import Backend, BackendSpec
from gateway.fleet.pool import Pool
from gateway.fleet.upstream import UpstreamClient
from tests.fake_clock import FakeClock


def backend(url: str) -> BackendSpec:
    return BackendSpec(url)


def test_remembers_the_backend_of_each_response_until_forgotten() -> None:
    owners = ResponseOwners(max_ids=10, ttl_s=60)
    a, b = backend("http://a"), backend("http://b")
    owners.remember("resp_1", a)
    owners.remember("resp_2", b)
    assert owners.owner("resp_1") is a and owners.owner("resp_2") is b and owners.owner("resp_3") is None
    owners.forget("resp_1")
    assert owners.owner("resp_1") is None and len(owners) == 1


def test_the_oldest_ids_are_dropped_beyond_the_bound() -> None:
    owners = ResponseOwners(max_ids=3, ttl_s=60)
    a = backend("http://a")
    for index in range(5):
        owners.remember(f"resp_{index}", a)
    assert len(owners) == 3
    assert owners.owner("resp_1") is None and owners.owner("resp_2") is a and owners.owner("resp_4") is a


def test_records_expire_after_the_ttl() -> None:
    clock = FakeClock()
    owners = ResponseOwners(max_ids=10, ttl_s=60, clock=clock)
    a = backend("http://a")
    owners.remember("resp_old", a)
    clock.now_s = 30
    owners.remember("resp_new", a)
    clock.now_s = 61
    assert owners.owner("resp_old") is None and owners.owner("resp_new") is a
    clock.now_s = 91
    assert owners.owner("resp_new") is None and len(owners) == 0


def test_the_id_is_read_from_a_response_or_an_event_wrapping_one() -> None:
    assert response_id_of({"id": "resp_1", "object": "response"}) == "resp_1"
    assert response_id_of({"type": "response.completed", "response": {"id": "resp_2"}}) == "resp_2"
    assert response_id_of({"error": {"message": "no"}}) is None
    assert response_id_of(None) is None


def stored_on(url: str) -> tuple[Pool, StoredResponses]:
    """Two healthy backends; `resp_1` stored on the one at `url`."""
    pool = Pool([BackendSpec("http://a"), BackendSpec("http://b")], index_capacity_blocks=16, retry_after_s=1)
    for each in pool.backends:
        each.health_check_passed(success_threshold=1)
    # The client only asks for ids nobody remembers; these tests name a remembered one.
    stored = StoredResponses(ResponseOwners(max_ids=10, ttl_s=60), pool, cast(UpstreamClient, None), 1.0, False)
    found = pool.find(url)
    assert found is not None
    stored.answered(found, None, "POST", {"id": "resp_1"})
    return pool, stored


def owner_of(stored: StoredResponses, param: str | None) -> Backend | None:
    return asyncio.run(stored.owner_of("resp_1", param, None))


def test_a_backend_that_left_and_joined_again_serves_its_stored_responses() -> None:
    pool, stored = stored_on("http://a")
    leaving = pool.find("http://a")
    assert leaving is not None
    pool.remove(leaving)
    with pytest.raises(StoredResponseUnavailable):
        owner_of(stored, "previous_response_id")
    back = pool.add(BackendSpec("http://a"))  # a DNS flip, a rewritten backends file, an admin DELETE and POST
    back.health_check_passed(success_threshold=1)
    assert owner_of(stored, "previous_response_id") is back and owner_of(stored, None) is back


def test_a_draining_owner_still_serves_get_delete_and_cancel_but_no_follow_up() -> None:
    pool, stored = stored_on("http://a")
    owner = pool.find("http://a")
    assert owner is not None
    pool.drain(owner)
    assert owner_of(stored, None) is owner  # GET, DELETE, cancel: the path names the response
    with pytest.raises(StoredResponseUnavailable):
        owner_of(stored, "previous_response_id")  # new work
