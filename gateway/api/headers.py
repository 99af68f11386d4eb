"""Which headers cross the gateway, in each direction (RFC 9110 section 7.6: a proxy's duties).

To the backend: the client's headers as it sent them, less the hop-by-hop ones and any the client's
`Connection` header names, less `Expect` (the gateway forwards a body it has already read), less credentials
meant for the gateway (`Authorization`, `Cookie`, and Anthropic's `X-Api-Key`; a backend's own key is sent
instead when configured), with our request id and the client's address in `X-Forwarded-For` and `Forwarded`
(appended to what a trusted proxy in front of us sent, replaced otherwise).
To the client: the backend's headers less the hop-by-hop ones and those the server writes itself.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from multidict import CIMultiDictProxy

from gateway.errors import BadRequest

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "trailers", "transfer-encoding", "upgrade", "proxy-connection"})
# expect: the gateway reads the whole body before it forwards; a client's 100-continue was answered here.
_NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "expect", "x-request-id", "x-forwarded-for", "forwarded"}
_CREDENTIALS = frozenset({"authorization", "cookie", "x-api-key"})
# date/server: the server writes its own; content-length: recomputed for what we send.
_NOT_RELAYED = HOP_BY_HOP | {"date", "server", "content-length"}
MAX_REQUEST_ID_CHARS = 128

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class HeaderPolicy:
    forward_credentials: bool = False        # pass the client's Authorization and Cookie to backends
    trusted_proxies: tuple[Network, ...] = ()  # whose X-Forwarded-For we extend rather than replace

    @cached_property
    def not_forwarded(self) -> frozenset[str]:
        """The (lower-case) names of the client's headers never sent upstream, made once."""
        return _NOT_FORWARDED if self.forward_credentials else _NOT_FORWARDED | _CREDENTIALS

    def trusts(self, peer: str | None) -> bool:
        if not self.trusted_proxies or not peer:
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return False
        return any(address in network for network in self.trusted_proxies)


def client_request_id(headers: CIMultiDictProxy[str], generated: str) -> str:
    """The client's `x-request-id` when it is a sane one, else ours: it ends up in every log line."""
    given = headers.get("x-request-id")
    if given and len(given) <= MAX_REQUEST_ID_CHARS and given.isprintable() and given.isascii():
        return given
    return generated


def forwarded_headers(headers: CIMultiDictProxy[str], request_id: str, peer: str | None,
                      policy: HeaderPolicy) -> list[tuple[str, str]]:
    """The client's headers as sent upstream, to any backend; raises BadRequest for a value that is not UTF-8
    (it cannot be re-sent)."""
    dropped = policy.not_forwarded
    named = headers.get("connection")
    if named:
        dropped = dropped | {token.strip().lower() for token in named.split(",")}
    sent = [(name, _checked(name, value)) for name, value in headers.items() if name.lower() not in dropped]
    sent.append(("x-request-id", request_id))
    if peer:
        sent += _forwarded_for(headers, peer, policy)
    return sent


def with_backend_key(sent: list[tuple[str, str]], backend_key: str | None) -> list[tuple[str, str]]:
    """`sent` for a backend with a key of its own (vLLM's --api-key): that key instead of any client's."""
    if backend_key is None:
        return sent
    return [(name, value) for name, value in sent if name.lower() != "authorization"] + [
        ("Authorization", f"Bearer {backend_key}")]


def _checked(name: str, value: str) -> str:
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(f"The header {name!r} is not valid UTF-8.") from None
    return value


def _forwarded_for(headers: CIMultiDictProxy[str], peer: str, policy: HeaderPolicy) -> list[tuple[str, str]]:
    node = f'"[{peer}]"' if ":" in peer else peer
    if policy.trusts(peer):
        chain = ", ".join(headers.getall("x-forwarded-for", []) + [peer])
        forwarded = ", ".join(headers.getall("forwarded", []) + [f"for={node}"])
    else:
        chain, forwarded = peer, f"for={node}"
    return [("X-Forwarded-For", chain), ("Forwarded", forwarded)]


def relayed_headers(headers: CIMultiDictProxy[str]) -> Iterable[tuple[str, str]]:
    named = headers.get("connection")
    dropped = _NOT_RELAYED | {t.strip().lower() for t in named.split(",")} if named else _NOT_RELAYED
    return ((name, value) for name, value in headers.items() if name.lower() not in dropped)


def parse_networks(values: Sequence[str]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(value, strict=False) for value in values)
