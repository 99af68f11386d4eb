"""The map of stored responses to the backends that hold them: bounded, aged, forgettable."""

from gateway.api.responses import ResponseOwners, response_id_of
from gateway.fleet.backends import Backend, BackendSpec
from gateway.routing.prefix_index import PrefixIndex


def backend(url: str) -> Backend:
    return Backend(BackendSpec(url), PrefixIndex(16, iter(range(1, 1000)).__next__))


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


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
    clock = Clock()
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
