"""Client API keys: OpenAI's `Authorization: Bearer KEY`, compared in constant time.

With no keys configured every client is let in (the gateway then trusts its network, as the engines do).
Keys guard every route but `/health` and `/ready` (probes carry no keys). An admin key, when set, is the only
one that opens `/metrics`, `/backends` and `/dashboard`; without one, any client key does.
"""

from __future__ import annotations

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
        given = _bearer(headers.get("authorization", "")) or headers.get("x-api-key", "").encode()
        # Compare with every key, so the time taken does not tell which one nearly matched.
        if not any([hmac.compare_digest(given, key) for key in allowed]):
            raise Unauthorized()


def _bearer(value: str) -> bytes:
    scheme, _, token = value.partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" else b""
