"""Client API keys: who may use which route."""

from __future__ import annotations

import base64

import pytest

from gateway.api.auth import ApiKeys
from gateway.errors import Unauthorized


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_no_keys_lets_everyone_in() -> None:
    keys = ApiKeys([], [])
    assert not keys.enabled
    keys.check("/v1/chat/completions", {})


def test_client_key_is_required_on_every_route_but_probes() -> None:
    keys = ApiKeys(["k1", "k2"], [])
    keys.check("/v1/chat/completions", bearer("k2"))
    keys.check("/v1/messages", {"x-api-key": "k1"})  # Anthropic's header
    keys.check("/health", {})
    keys.check("/ready", {})
    for headers in ({}, bearer("k3"), {"authorization": "k1"}, bearer("")):
        with pytest.raises(Unauthorized) as refused:
            keys.check("/v1/chat/completions", headers)
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"


def test_admin_key_alone_opens_metrics_and_backends() -> None:
    keys = ApiKeys(["client"], ["admin"])
    keys.check("/metrics", bearer("admin"))
    keys.check("/backends", bearer("admin"))
    with pytest.raises(Unauthorized):
        keys.check("/metrics", bearer("client"))
    with pytest.raises(Unauthorized):
        keys.check("/v1/chat/completions", bearer("admin"))


def test_dashboard_takes_the_key_as_a_basic_auth_password_and_asks_the_browser_for_it() -> None:
    keys = ApiKeys(["client"], [])
    keys.check("/dashboard", {"authorization": "Basic " + base64.b64encode(b"anyone:client").decode()})
    with pytest.raises(Unauthorized) as refused:
        keys.check("/dashboard/data", {"authorization": "Basic !!!"})
    assert refused.value.headers()["www-authenticate"].startswith("Basic")
