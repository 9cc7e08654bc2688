"""The admission gate of a router replica: bounded running, bounded waiting in arrival order,
refusal beyond, and no slot lost to a caller that goes away."""

from __future__ import annotations

import asyncio

import pytest

from router.gate import GateFull, RequestGate


def test_admits_then_queues_then_refuses_in_arrival_order():
    async def scenario():
        gate = RequestGate(max_running=2, max_queued=2)
        first, second = await gate.enter(), await gate.enter()
        order = []

        async def wait(name):
            slot = await gate.enter()
            order.append(name)
            return slot

        waiters = [asyncio.create_task(wait(n)) for n in ("third", "fourth")]
        assert gate.admits                # both slots taken, the line empty
        await asyncio.sleep(0)
        assert (gate.running, gate.queued) == (2, 2) and not gate.admits
        with pytest.raises(GateFull):
            await gate.enter()
        assert gate.refused == 1
        first.release()
        first.release()                  # idempotent: frees one slot, not two
        await asyncio.sleep(0)
        assert order == ["third"] and (gate.running, gate.queued) == (2, 1) and gate.admits
        second.release()
        slots = await asyncio.gather(*waiters)
        assert order == ["third", "fourth"]
        for slot in slots:
            slot.release()
        assert (gate.running, gate.queued) == (0, 0)

    asyncio.run(scenario())


async def one_running_two_waiting():
    """A gate of one slot, held, with two callers waiting in line: (gate, held, first, second)."""
    gate = RequestGate(max_running=1, max_queued=2)
    held = await gate.enter()
    first, second = asyncio.create_task(gate.enter()), asyncio.create_task(gate.enter())
    await asyncio.sleep(0)
    return gate, held, first, second


def test_a_waiter_that_goes_away_leaves_the_line_and_loses_no_slot():
    async def scenario():
        gate, held, leaving, staying = await one_running_two_waiting()
        leaving.cancel()
        await asyncio.sleep(0)
        assert gate.queued == 1
        held.release()
        (await staying).release()
        assert (gate.running, gate.queued) == (0, 0)

    asyncio.run(scenario())


def test_a_slot_handed_to_a_cancelled_waiter_passes_on():
    async def scenario():
        gate, held, unlucky, next_in_line = await one_running_two_waiting()
        held.release()          # the slot goes to `unlucky` ...
        unlucky.cancel()        # ... which is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await unlucky
        (await asyncio.wait_for(next_in_line, 1)).release()
        assert (gate.running, gate.queued) == (0, 0)

    asyncio.run(scenario())
