"""The cap on open client connections, in process: what the server's protocol factory hands out."""

from __future__ import annotations

import asyncio

from aiohttp import web

from gateway.api.connections import ConnectionCap


async def test_a_burst_accepted_before_any_connection_is_made_still_stops_at_the_cap() -> None:
    server = web.Server(lambda request: web.Response())  # type: ignore[arg-type,return-value]
    cap = ConnectionCap(server, max_connections=3)
    burst = [cap() for _ in range(5)]  # what the loop does for 5 queued connections, before any runs
    assert [isinstance(protocol, web.RequestHandler) for protocol in burst] == [True, True, True, False, False]
    assert cap.refused_total == 2
    await asyncio.sleep(0)  # their connection_made would run now; the handed-out count settles
    assert cap._accepting == 0
