"""The admin API in process: its guard and its answers to bad requests, in OpenAI's error shape. With real
processes (adding a replica that then serves, draining, removing): tests/test_e2e_fleet.py."""

from __future__ import annotations

from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from gateway.api.admin import AdminApi
from gateway.api.auth import ApiKeys
from gateway.config import check_url
from gateway.fleet.backends import BackendSpec
from gateway.fleet.discovery import Membership
from gateway.fleet.pool import Pool

KEY = {"authorization": "Bearer admin-key"}


def admin_api(admin_keys: list[str]) -> tuple[AdminApi, list[str]]:
    pool = Pool([BackendSpec("http://10.0.0.1:8000", name="first")], 100, retry_after_s=1)
    joined: list[str] = []
    membership = Membership(pool, lambda backend: joined.append(backend.url), lambda backend: None)
    return AdminApi(membership, ApiKeys(["client-key"], admin_keys), check_url), joined


async def answer(client: TestClient[Any, Any], method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
    async with client.request(method, path, **kwargs) as response:
        return response.status, await response.json()


async def test_a_client_key_never_opens_the_admin_api() -> None:
    api, _ = admin_api(["admin-key"])
    async with TestClient(TestServer(api.app())) as client:
        status, body = await answer(client, "GET", "/admin/backends", headers={"authorization": "Bearer client-key"})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, body = await answer(client, "GET", "/admin/backends", headers={"x-api-key": "admin-key"})
        assert status == 200 and [b["name"] for b in body["backends"]] == ["first"]


async def test_without_an_admin_key_the_loopback_admin_api_is_open() -> None:
    api, _ = admin_api([])
    async with TestClient(TestServer(api.app())) as client:
        status, _ = await answer(client, "GET", "/admin/backends")
        assert status == 200


async def test_bad_requests_are_400_naming_the_field_and_nothing_is_added() -> None:
    api, joined = admin_api(["admin-key"])
    async with TestClient(TestServer(api.app())) as client:
        for body, param in (({"url": "http://10.0.0.2:8000", "weight": 2}, "weight"),
                            ({"url": "ftp://10.0.0.2"}, "url"), ({"url": "http://10.0.0.2:8000", "name": 3}, "name")):
            status, error = await answer(client, "POST", "/admin/backends", json=body, headers=KEY)
            assert status == 400 and error["error"]["param"] == param and error["error"]["type"] == \
                "invalid_request_error"
        status, error = await answer(client, "POST", "/admin/backends", data=b"{not json", headers=KEY)
        assert status == 400
        status, error = await answer(client, "PUT", "/admin/backends", headers=KEY)
        assert status == 405 and "error" in error
    assert joined == [] and len(api.pool.backends) == 1


async def test_an_added_backend_is_named_by_its_address_and_checked_at_once() -> None:
    api, joined = admin_api(["admin-key"])
    async with TestClient(TestServer(api.app())) as client:
        status, body = await answer(client, "POST", "/admin/backends", json={"url": "http://10.0.0.2:8000/"},
                                    headers=KEY)
        assert status == 201 and body["backend"]["name"] == "10.0.0.2:8000" and body["backend"]["healthy"] is False
        status, body = await answer(client, "POST", "/admin/backends", json={"url": "http://10.0.0.3:8000",
                                                                            "name": "first"}, headers=KEY)
        assert status == 409 and body["error"]["code"] == "backend_exists"
        status, body = await answer(client, "DELETE", "/admin/backends/10.0.0.2:8000", headers=KEY)
        assert status == 202 and body["removed"] is True  # nothing in flight: gone at once
    assert joined == ["http://10.0.0.2:8000"] and [b.name for b in api.pool.backends] == ["first"]
