"""The bounded, aged map behind session keys and stored-response owners."""

from gateway.expiring import ExpiringLru
from tests.fake_clock import FakeClock


def test_the_least_recently_put_key_leaves_first_beyond_the_bound() -> None:
    entries: ExpiringLru[str, int] = ExpiringLru(max_entries=2, ttl_s=60.0)
    entries.put("a", 1)
    entries.put("b", 2)
    entries.put("a", 3)  # put again: "b" is now the oldest
    entries.put("c", 4)
    assert len(entries) == 2 and entries.get("b") is None and entries.get("a") == 3 and entries.get("c") == 4


def test_an_entry_leaves_ttl_after_its_last_put_and_a_read_does_not_refresh_it() -> None:
    clock = FakeClock()
    entries: ExpiringLru[str, int] = ExpiringLru(max_entries=10, ttl_s=5.0, clock=clock)
    entries.put("old", 1)
    clock.now_s = 4.0
    entries.put("new", 2)
    assert entries.get("old") == 1
    clock.now_s = 6.0
    assert entries.get("old") is None and entries.get("new") == 2 and len(entries) == 1
    clock.now_s = 9.0
    assert entries.get("new") is None and len(entries) == 0


def test_a_popped_key_is_gone() -> None:
    entries: ExpiringLru[int, str] = ExpiringLru(max_entries=10, ttl_s=60.0)
    entries.put(1, "x")
    entries.pop(1)
    entries.pop(2)  # absent: nothing to do
    assert entries.get(1) is None and len(entries) == 0
