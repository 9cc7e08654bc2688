"""Continuous batching: calls that queue while a batch runs form the next batch together."""

from __future__ import annotations

import asyncio

import pytest

from replicas.batcher import Batcher


def test_calls_queued_behind_a_busy_model_run_as_one_batch():
    sizes: list[int] = []

    async def run_batch(items: list[int]) -> list[int]:
        sizes.append(len(items))
        await asyncio.sleep(0.05)  # the model is busy; more calls queue meanwhile
        return [item * 10 for item in items]

    async def scenario() -> list[int]:
        batcher = Batcher(run_batch, max_batch_size=4, wait_s=0.0)
        first = asyncio.create_task(batcher.submit(0))
        await asyncio.sleep(0.01)                   # the first call is running alone
        rest = [asyncio.create_task(batcher.submit(i)) for i in range(1, 7)]
        return [await first] + [await task for task in rest]

    assert asyncio.run(scenario()) == [0, 10, 20, 30, 40, 50, 60]
    assert sizes == [1, 4, 2]  # then up to max_batch_size at a time, in arrival order


def test_an_error_reaches_every_caller_of_its_batch_and_the_batcher_goes_on():
    async def run_batch(items: list[int]) -> list[int]:
        if 13 in items:
            raise ValueError("bad batch")
        return items

    async def scenario():
        batcher = Batcher(run_batch, max_batch_size=8, wait_s=0.01)
        results = await asyncio.gather(batcher.submit(1), batcher.submit(13), return_exceptions=True)
        return results, await batcher.submit(2)

    results, after = asyncio.run(scenario())
    assert all(isinstance(r, ValueError) for r in results) and after == 2


@pytest.mark.parametrize("wait_s", [0.0, 0.05])
def test_wait_window_gathers_a_group_that_arrives_almost_together(wait_s):
    sizes: list[int] = []

    async def run_batch(items):
        sizes.append(len(items))
        return items

    async def scenario():
        batcher = Batcher(run_batch, max_batch_size=8, wait_s=wait_s)
        await asyncio.gather(batcher.submit(1), batcher.submit(2))  # queued together: a batch of 2
        first = asyncio.create_task(batcher.submit(3))
        await asyncio.sleep(0.005)
        await asyncio.gather(first, batcher.submit(4))

    asyncio.run(scenario())
    assert sizes == ([2, 1, 1] if wait_s == 0 else [2, 2])


def test_a_lone_stream_does_not_wait_for_company():
    async def run_batch(items):
        return items

    async def scenario():
        batcher = Batcher(run_batch, max_batch_size=8, wait_s=30.0)
        for i in range(3):  # each would take 30 s if the batcher waited for a second call
            assert await asyncio.wait_for(batcher.submit(i), timeout=5) == i

    asyncio.run(scenario())
