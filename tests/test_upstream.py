"""unless_client_leaves: the wait for an answer's headers ends when the client leaves, and loses nothing."""

from __future__ import annotations

import asyncio

import pytest
from starlette.types import Message

from gateway.upstream import unless_client_leaves


async def never_disconnects() -> Message:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def disconnects() -> Message:
    return {"type": "http.disconnect"}


def test_a_client_that_leaves_cancels_the_exchange_being_opened() -> None:
    cancelled = []

    async def opening() -> str:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)  # where the gateway releases the backend
            raise
        return "exchange"

    async def abandon(unused: str) -> None:
        raise AssertionError("nothing was opened")

    assert asyncio.run(unless_client_leaves(disconnects, opening(), abandon)) is None
    assert cancelled == [True]


def test_an_exchange_opened_as_the_server_stops_is_abandoned_not_lost() -> None:
    abandoned: list[str] = []

    async def main() -> None:
        async def opening() -> str:
            waiting.cancel()  # the server stops in the very step the exchange opens
            return "exchange"

        async def abandon(late: str) -> None:
            abandoned.append(late)

        waiting = asyncio.ensure_future(unless_client_leaves(never_disconnects, opening(), abandon))
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(main())
    assert abandoned == ["exchange"]


def test_an_error_while_opening_reaches_the_caller() -> None:
    async def opening() -> str:
        raise ConnectionError("refused")

    async def abandon(unused: str) -> None:
        raise AssertionError("nothing was opened")

    with pytest.raises(ConnectionError):
        asyncio.run(unless_client_leaves(never_disconnects, opening(), abandon))
