"""Backends at run time without processes: diffing what a source says, the pool's add/drain/remove, restarts seen
through the process start time, and the series a removed backend leaves. End to end: tests/test_e2e_fleet.py."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from gateway.config import GatewayConfig, build_config
from gateway.errors import ConfigError
from gateway.fleet.backends import Backend, BackendSpec
from gateway.fleet.discovery import (
    DnsName,
    DnsSource,
    FileSource,
    Membership,
    Watch,
    diff,
    parse_backend_file,
)
from gateway.fleet.health import Upkeep
from gateway.fleet.pool import Pool
from gateway.fleet.shared_state import CLEARED, apply_update, backend_id
from gateway.observe.metrics import GatewayMetrics
from tests.policy_fixtures import request, text


class Resolver:
    """A name server whose answer the test changes; `None` answers as a failed lookup."""

    def __init__(self, addresses: Sequence[str] | None) -> None:
        self.addresses = addresses

    async def __call__(self, host: str, port: int) -> list[str]:
        if self.addresses is None:
            raise OSError(f"{host}: Name or service not known")
        return list(self.addresses)


class Recorder:
    def __init__(self) -> None:
        self.joined: list[str] = []
        self.left: list[str] = []

    def membership(self, pool: Pool) -> Membership:
        return Membership(pool, lambda b: self.joined.append(b.url), lambda b: self.left.append(b.url))


def up(backend: Backend) -> Backend:
    backend.model = "m"
    backend.health_check_passed(success_threshold=1)
    return backend


def test_diff_names_what_joined_and_what_left() -> None:
    assert diff({"a", "b"}, {"b", "c", "d"}) == (["c", "d"], ["a"])
    assert diff(set(), set()) == ([], [])


def test_backend_file_has_one_url_per_line_with_comments() -> None:
    text_ = "# replicas\nhttp://10.0.0.1:8000/\n\n  https://gpu-2:8000   # the big one\n"
    assert parse_backend_file(text_) == ["http://10.0.0.1:8000", "https://gpu-2:8000"]


def test_a_bad_line_rejects_the_whole_backend_file() -> None:
    with pytest.raises(ValueError, match="line 2"):
        parse_backend_file("http://10.0.0.1:8000\n10.0.0.2:8000\n")


@pytest.mark.parametrize("given, name, url", [
    ("vllm-headless:8000", DnsName("vllm-headless", 8000), "http://10.1.2.3:8000"),
    ("https://sglang.ns.svc:30000", DnsName("sglang.ns.svc", 30000, "https"), "https://10.1.2.3:30000"),
])
def test_dns_names_parse_and_build_backend_urls(given: str, name: DnsName, url: str) -> None:
    assert DnsName.parse(given) == name
    assert name.url("10.1.2.3") == url
    assert DnsName("h", 1).url("::1") == "http://[::1]:1"


@pytest.mark.parametrize("bad", ["vllm-headless", "ftp://h:1", "h:port", "h:1/path"])
def test_dns_names_without_a_port_or_with_a_path_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        DnsName.parse(bad)


def test_pool_add_refuses_a_url_or_name_it_has() -> None:
    pool = Pool([BackendSpec("http://a:1", name="a")], 100, retry_after_s=1)
    with pytest.raises(ValueError, match="URL"):
        pool.add(BackendSpec("http://a:1/", name="other"))
    with pytest.raises(ValueError, match="name"):
        pool.add(BackendSpec("http://b:1", name="a"))
    added = pool.add(BackendSpec("http://b:1", name="b"), source="admin")
    assert added.source == "admin" and not added.healthy and pool.find("b") is added and pool.version == 2


def test_a_draining_backend_is_never_chosen_and_its_model_not_offered() -> None:
    pool = Pool([BackendSpec("http://a:1"), BackendSpec("http://b:1")], 100, retry_after_s=1)
    a, b = (up(backend) for backend in pool.backends)
    pool.drain(a)
    assert pool.serving("m") == [b]
    pool.drain(b)
    assert pool.serving("m") == [] and pool.models() == [] and not pool.ready()


def test_remove_frees_the_index_and_leaves_the_backend_unhealthy() -> None:
    pool = Pool([BackendSpec("http://a:1")], 100, retry_after_s=1)
    backend = up(pool.backends[0])
    backend.index.insert(request(text("a conversation", 500)).hashes)
    pool.remove(backend)
    assert pool.backends == [] and backend.index.size_blocks == 0 and not backend.healthy


def test_dns_watch_joins_new_addresses_and_drains_vanished_ones_until_their_requests_finish() -> None:
    pool, recorder = Pool([], 100, retry_after_s=1), Recorder()
    membership = recorder.membership(pool)
    resolver = Resolver(["10.0.0.1", "10.0.0.2"])
    watch = Watch(DnsSource(DnsName("svc", 8000), 5.0, resolver), membership)
    asyncio.run(watch.poll())
    first, second = pool.backends
    assert recorder.joined == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert first.name == "10.0.0.1:8000" and first.source == "dns:svc:8000" and not first.healthy
    up(first), up(second)
    pending = first.reserve(10, [1, 2])  # a request in flight on the one about to vanish
    resolver.addresses = ["10.0.0.2", "10.0.0.3"]
    asyncio.run(watch.poll())
    assert first.draining and first in pool.backends and pool.serving("m") == [second]
    first.prefill_done(pending)
    first.release([1, 2])
    membership.reap()
    assert first not in pool.backends and recorder.left == ["http://10.0.0.1:8000"]
    assert [b.url for b in pool.backends] == ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]


def test_a_failed_lookup_keeps_the_backends_and_a_returning_address_stops_draining() -> None:
    pool, recorder = Pool([], 100, retry_after_s=1), Recorder()
    membership = recorder.membership(pool)
    resolver = Resolver(["10.0.0.1"])
    watch = Watch(DnsSource(DnsName("svc", 8000), 5.0, resolver), membership)
    asyncio.run(watch.poll())
    backend = up(pool.backends[0])
    backend.reserve(10, [1])
    resolver.addresses = None
    asyncio.run(watch.poll())
    assert not backend.draining
    resolver.addresses = []
    asyncio.run(watch.poll())
    assert backend.draining
    resolver.addresses = ["10.0.0.1"]
    asyncio.run(watch.poll())
    assert not backend.draining and pool.serving("m") == [backend] and recorder.joined == [backend.url]


def test_a_source_never_removes_a_configured_backend_with_the_same_url() -> None:
    pool, recorder = Pool([BackendSpec("http://10.0.0.1:8000", name="static")], 100, retry_after_s=1), Recorder()
    resolver = Resolver(["10.0.0.1"])
    watch = Watch(DnsSource(DnsName("svc", 8000), 5.0, resolver), recorder.membership(pool))
    asyncio.run(watch.poll())
    resolver.addresses = []
    asyncio.run(watch.poll())
    assert [(b.name, b.draining) for b in pool.backends] == [("static", False)] and recorder.joined == []


def test_file_watch_applies_an_edit_and_ignores_a_broken_one(tmp_path: Path) -> None:
    path = tmp_path / "backends.txt"
    path.write_text("http://10.0.0.1:8000\nhttp://10.0.0.2:8000\n")
    pool, recorder = Pool([], 100, retry_after_s=1), Recorder()
    source = FileSource(str(path))
    watch = Watch(source, recorder.membership(pool))
    asyncio.run(watch.poll())
    assert len(pool.backends) == 2
    assert asyncio.run(source.read()) is None  # unchanged: nothing to do
    path.write_text("http://10.0.0.2:8000\nnot a url\n")
    asyncio.run(watch.poll())
    assert not any(b.draining for b in pool.backends)
    path.write_text("# only one left\nhttp://10.0.0.2:8000\n")
    asyncio.run(watch.poll())
    assert [b.url for b in pool.backends] == ["http://10.0.0.2:8000"]  # nothing in flight: gone at once
    assert recorder.left == ["http://10.0.0.1:8000"]


def test_a_moved_process_start_time_clears_the_index_and_tells_the_other_instances() -> None:
    cleared: list[str] = []

    class Publisher:
        def placed(self, backend: Backend, hashes: Sequence[int]) -> None: ...

        def corrected(self, backend: Backend, hashes: Sequence[int], keep_blocks: int) -> None: ...

        def marked_down(self, backend: Backend) -> None: ...

        def cleared(self, backend: Backend) -> None:
            cleared.append(backend.url)

        def session_visited(self, backend: Backend, key: int, blocks: int, last_hash: int) -> None: ...

    pool = Pool([BackendSpec("http://a:1")], 100, retry_after_s=1)
    backend = up(pool.backends[0])
    backend.publisher = Publisher()
    backend.index.insert(request(text("a conversation", 500)).hashes)
    backend.start_time_read(1000.0)
    backend.start_time_read(1000.3)  # the same process: the value wanders a little
    assert backend.index.size_blocks > 0 and cleared == []
    backend.start_time_read(1060.0)
    assert backend.index.size_blocks == 0 and cleared == ["http://a:1"] and backend.healthy


def test_a_refused_check_then_a_good_one_clears_the_index_of_an_engine_without_start_time() -> None:
    pool = Pool([BackendSpec("http://a:1")], 100, retry_after_s=1)
    backend = up(pool.backends[0])
    backend.index.insert(request(text("a conversation", 500)).hashes)
    backend.health_check_failed("GET /health failed: refused", failure_threshold=3, refused=True)
    assert backend.healthy and backend.index.size_blocks > 0
    backend.health_check_passed(success_threshold=1)
    assert backend.index.size_blocks == 0


def test_another_instances_restart_verdict_clears_the_index() -> None:
    pool = Pool([BackendSpec("http://a:1")], 100, retry_after_s=1)
    backend = up(pool.backends[0])
    backend.index.insert(request(text("a conversation", 500)).hashes)
    assert apply_update({backend_id(backend.url): backend}, CLEARED, backend_id(backend.url), (), age_s=0.0)
    assert backend.index.size_blocks == 0 and backend.healthy


def test_a_removed_backends_series_are_forgotten() -> None:
    pool = Pool([BackendSpec("http://a:1"), BackendSpec("http://b:1")], 100, retry_after_s=1)
    metrics = GatewayMetrics(pool)
    for url in ("http://a:1", "http://b:1"):
        metrics.request_done("chat", "m", url, "cache_hit", "200", 0.1, 0.05, 0.5)
        metrics.upstream_errors.labels(url, "connect").inc()
        for counter in metrics.token_counters("m", url):
            counter.inc(10)
    pool.remove(pool.backends[0])
    metrics.forget_backend("http://a:1")
    rendered = metrics.render().decode()
    assert 'backend="http://a:1"' not in rendered and 'backend="http://b:1"' in rendered
    metrics.request_done("chat", "m", "http://b:1", "cache_hit", "200", 0.1, 0.05, 0.5)  # b's children still bound


@pytest.mark.parametrize("values, named", [
    ({"admin_port": 9000, "admin_host": "0.0.0.0"}, "admin_api_key"),
    ({"admin_port": 9000, "workers": 2}, "workers = 1"),
    ({"backend_dns": ["no-port"]}, "backend_dns"),
    ({"backend_dns_interval_secs": 0}, "backend_dns_interval_secs"),
])
def test_bad_run_time_backend_options_are_refused(values: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        build_config(values, {})


def test_the_admin_api_may_listen_anywhere_with_an_admin_key_or_on_loopback_without() -> None:
    assert build_config({"admin_port": 9000, "admin_host": "::1"}, {}).admin_port == 9000
    config = build_config({"admin_port": 9000, "admin_host": "0.0.0.0", "admin_api_key": "k"}, {})
    assert config.admin_host == "0.0.0.0"


class FakeClient:
    """Every backend answers /health and names model "m"; nothing else."""

    def __init__(self) -> None:
        self.checked: list[str] = []

    async def get_status(self, url: str, timeout_s: float) -> tuple[int, None]:
        self.checked.append(url.removesuffix("/health"))
        return 200, None

    async def get_bytes(self, url: str, timeout_s: float) -> bytes | None:
        return b'{"data": [{"id": "m"}]}' if url.endswith("/v1/models") else None


def test_health_checks_take_up_an_added_backend_at_once_and_stop_for_a_removed_one() -> None:
    pool, client = Pool([BackendSpec("http://a:1")], 100, retry_after_s=1), FakeClient()
    upkeep = Upkeep(pool, client, GatewayConfig())  # type: ignore[arg-type]

    async def run() -> tuple[bool, list[str]]:
        await upkeep.start()
        added = pool.add(BackendSpec("http://b:1"))
        upkeep.check_soon(added)
        for _ in range(10):
            await asyncio.sleep(0)
        joined = added.healthy
        pool.remove(pool.backends[0])
        client.checked.clear()
        await upkeep.check_all()
        await upkeep.stop()
        return joined, client.checked

    joined, checked = asyncio.run(run())
    assert joined and checked == ["http://b:1"]
