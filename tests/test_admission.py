"""Admission control: a bounded number of requests at once, a bounded wait, then 429."""

from __future__ import annotations

import asyncio

import pytest

from gateway.api.admission import Admission
from gateway.errors import Overloaded


async def test_shed_requests_do_not_free_slots_they_never_held() -> None:
    admission = Admission(max_concurrent=1, max_wait_s=0.01)
    await admission.enter()
    for _ in range(3):
        with pytest.raises(Overloaded):
            await admission.enter()
    assert admission.in_flight == 1 and admission.waiting == 0
    admission.leave()
    assert admission.in_flight == 0


async def test_slot_goes_to_the_oldest_waiter() -> None:
    admission = Admission(max_concurrent=1, max_wait_s=5.0)
    await admission.enter()
    order: list[int] = []

    async def wait(number: int) -> None:
        await admission.enter()
        order.append(number)

    waiters = [asyncio.ensure_future(wait(number)) for number in range(3)]
    await asyncio.sleep(0)
    for _ in range(3):
        admission.leave()
        await asyncio.sleep(0)
    await asyncio.gather(*waiters)
    assert order == [0, 1, 2] and admission.in_flight == 1


async def test_waiter_that_leaves_takes_no_slot_with_it() -> None:
    admission = Admission(max_concurrent=1, max_wait_s=5.0)
    await admission.enter()
    waiter = asyncio.ensure_future(admission.enter())
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    admission.leave()
    assert admission.in_flight == 0 and admission.waiting == 0
