"""Client API keys: OpenAI's `Authorization: Bearer KEY`, compared in constant time.

With no keys configured every client is let in (the gateway then trusts its network, as the engines do).
Keys guard every route but `/health` and `/ready` (probes carry no keys). An admin key, when set, is the only
one that opens `/metrics`, `/backends` and `/dashboard`; without one, any client key does. A browser cannot
send a Bearer header to a page, so `/dashboard` also takes the key as the password of HTTP Basic auth (any
user name): the browser asks for it once and sends it with the page's data requests too. The admin API
(`--admin-port`, api/admin.py) takes the admin key only.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Iterable, Mapping

from gateway.errors import Unauthorized

_OPEN_PATHS = frozenset({"/health", "/ready"})
_ADMIN_PREFIXES = ("/metrics", "/backends", "/dashboard")


class ApiKeys:
    def __init__(self, client_keys: Iterable[str], admin_keys: Iterable[str]) -> None:
        self._client = tuple(key.encode() for key in client_keys)
        self._admin = tuple(key.encode() for key in admin_keys)

    @property
    def enabled(self) -> bool:
        return bool(self._client or self._admin)

    def check(self, path: str, headers: Mapping[str, str]) -> None:
        """Raises Unauthorized unless the request may use `path`."""
        if path in _OPEN_PATHS:
            return
        admin = path.startswith(_ADMIN_PREFIXES)
        allowed = self._admin if admin and self._admin else self._client
        if not allowed:
            return
        if not _matches(headers, allowed):
            raise BrowserUnauthorized() if path.startswith("/dashboard") else Unauthorized()

    def check_admin(self, headers: Mapping[str, str]) -> None:
        """Raises Unauthorized unless the request carries an admin key: for the admin API's own listener, which
        client keys never open. With no admin key it is open (config.py allows that on loopback only)."""
        if self._admin and not _matches(headers, self._admin):
            raise Unauthorized("Incorrect or missing admin API key: send it as 'Authorization: Bearer KEY'.")


def _matches(headers: Mapping[str, str], allowed: tuple[bytes, ...]) -> bool:
    given = _presented(headers.get("authorization", "")) or headers.get("x-api-key", "").encode()
    # Compare with every key, so the time taken does not tell which one nearly matched.
    return any([hmac.compare_digest(given, key) for key in allowed])


class BrowserUnauthorized(Unauthorized):
    def headers(self) -> dict[str, str]:
        return {"www-authenticate": 'Basic realm="prefix-gateway", charset="UTF-8"'}


def _presented(value: str) -> bytes:
    """The key in `Authorization: Bearer KEY`, or the password of `Authorization: Basic ...`."""
    scheme, _, token = value.partition(" ")
    if scheme.lower() == "bearer":
        return token.strip().encode()
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(token.strip(), validate=True).partition(b":")[2]
        except (binascii.Error, ValueError):
            return b""
    return b""
