"""The adapter's shared deadline timer (mesh/adapters/deadlines.py): asyncio.timeout's outcomes
(TimeoutError when the deadline passes, an outside cancel stays a cancel, None = unbounded) on
one timer, and a heap that does not grow with the requests that ended early."""

from __future__ import annotations

import asyncio

import pytest

from mesh.adapters.deadlines import Deadlines
from tests.conftest import run


def test_a_passed_deadline_is_a_timeout_and_leaves_the_task_uncancelled():
    async def go():
        d = Deadlines()
        with pytest.raises(TimeoutError):
            async with d.bound(0.01):
                await asyncio.sleep(30)
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        await asyncio.sleep(0)  # no cancel left pending either
        return d.expired, d.pending

    assert run(go(), 10) == (1, 0)


@pytest.mark.parametrize("timeout_s", [0.0, -5.0])
def test_a_zero_or_negative_bound_expires_at_the_first_wait(timeout_s):
    async def go():
        d = Deadlines()
        with pytest.raises(TimeoutError):
            async with d.bound(timeout_s):
                await asyncio.sleep(30)
        return d.expired

    assert run(go(), 10) == 1


def test_none_is_unbounded_and_an_outside_cancel_stays_a_cancel():
    async def go():
        d = Deadlines()
        async with d.bound(None):
            await asyncio.sleep(0.01)
        assert d.pending == 0

        async def bounded():
            async with d.bound(30):
                await asyncio.sleep(30)

        t = asyncio.create_task(bounded())
        await asyncio.sleep(0.01)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        return d.expired, d.pending

    assert run(go(), 10) == (0, 0)


def test_an_earlier_deadline_after_a_later_one_still_expires_first():
    async def go():
        d = Deadlines()
        order: list[str] = []

        async def bounded(name: str, timeout_s: float):
            try:
                async with d.bound(timeout_s):
                    await asyncio.sleep(30)
            except TimeoutError:
                order.append(name)

        slow = asyncio.create_task(bounded("slow", 20))
        await asyncio.sleep(0)
        await asyncio.wait_for(bounded("quick", 0.02), 10)
        assert not slow.done()
        slow.cancel()
        await asyncio.gather(slow, return_exceptions=True)
        return order

    assert run(go(), 15) == ["quick"]


def test_requests_that_end_early_do_not_grow_the_heap():
    async def go():
        d = Deadlines()
        for _ in range(20_000):
            async with d.bound(600):
                pass
        return d.entries, d.pending, d.expired

    size, pending, expired = run(go(), 30)
    assert pending == 0 and expired == 0
    assert size <= 4 * 1024, size


def test_one_instance_used_from_a_second_event_loop_still_expires_there():
    d = Deadlines()

    async def bounded(timeout_s: float) -> str:
        try:
            async with d.bound(timeout_s):
                await asyncio.sleep(30)
        except TimeoutError:
            return "expired"
        return "ended"

    async def first():  # leaves a long deadline armed on a loop that then closes
        t = asyncio.create_task(bounded(20))
        await asyncio.sleep(0.01)
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)

    run(first(), 10)
    assert run(bounded(0.02), 10) == "expired"
