"""Continuous batching: calls that queue while a batch runs form the next batch together, and
a batch waits for the sequences known to call again."""

from __future__ import annotations

import asyncio
import time

import pytest

from replicas.batcher import Batcher


def _stream_of(call: tuple[str, int]) -> str:
    return call[0]


def _recording_batcher(sizes: list[int], max_batch_size: int, wait_s: float, busy_s: float = 0.0,
                       wait_for_active: bool = True) -> Batcher:
    async def run_batch(calls):
        sizes.append(len(calls))
        await asyncio.sleep(busy_s)
        return [value for _, value in calls]
    return Batcher(run_batch, _stream_of, max_batch_size, wait_s, wait_for_active)


async def _stream(batcher: Batcher, name: str, rounds: int, start_s: float = 0.0, between_s: float = 0.0):
    """One sequence: a call per round, with `between_s` spent elsewhere (the other pool)."""
    await asyncio.sleep(start_s)
    for r in range(rounds):
        assert await batcher.submit((name, r)) == r
        await asyncio.sleep(between_s)
    batcher.release(name)


def test_calls_queued_behind_a_busy_model_run_as_one_batch():
    sizes: list[int] = []

    async def scenario() -> list[int]:
        batcher = _recording_batcher(sizes, max_batch_size=4, wait_s=0.0, busy_s=0.05)
        first = asyncio.create_task(batcher.submit(("s0", 0)))
        await asyncio.sleep(0.01)                   # the first call is running alone
        rest = [asyncio.create_task(batcher.submit((f"s{i}", i))) for i in range(1, 7)]
        return [await first] + [await task for task in rest]

    assert asyncio.run(scenario()) == [0, 1, 2, 3, 4, 5, 6]
    assert sizes == [1, 4, 2]  # then up to max_batch_size at a time, in arrival order


def test_a_call_says_how_long_it_queued_behind_another_batch():
    """What the router's cost model subtracts from a round's overhead: time the model was busy
    with other calls, not idle."""
    async def scenario() -> tuple[float, float, float]:
        batcher = _recording_batcher([], max_batch_size=4, wait_s=0.0, busy_s=0.2)
        first = asyncio.create_task(batcher.submit_timed(("s0", 0)))
        await asyncio.sleep(0.05)                   # the first call is running alone
        (_, first_queued), (value, second_queued) = await asyncio.gather(first, batcher.submit_timed(("s1", 1)))
        assert value == 1
        _, idle_queued = await batcher.submit_timed(("s2", 2))     # nothing running: no queueing
        return first_queued, second_queued, idle_queued

    first, second, idle = asyncio.run(scenario())
    assert first < 0.02 and idle < 0.02
    assert 0.1 <= second <= 0.25                    # the rest of the first call's 0.2 s


def test_a_failing_call_fails_alone_and_the_batcher_goes_on():
    batches = []

    async def run_batch(calls):
        batches.append(list(calls))
        if ("b", 13) in calls:
            raise ValueError("poison")
        return [value for _, value in calls]

    async def scenario():
        batcher = Batcher(run_batch, _stream_of, max_batch_size=8, wait_s=0.01)
        results = await asyncio.gather(batcher.submit(("a", 1)), batcher.submit(("b", 13)),
                                       batcher.submit(("c", 3)), return_exceptions=True)
        return batcher, results, await batcher.submit(("a", 2))

    batcher, results, after = asyncio.run(scenario())
    assert results[0] == 1 and results[2] == 3 and after == 2
    assert isinstance(results[1], ValueError) and str(results[1]) == "poison"
    # the failed batch of three, then each call alone, then the next batch
    assert batches == [[("a", 1), ("b", 13), ("c", 3)], [("a", 1)], [("b", 13)], [("c", 3)], [("a", 2)]]
    assert batcher.isolation_reruns == 1


def test_streams_that_start_out_of_step_end_up_in_one_batch():
    # Two groups of four streams, the second starting while the first is in its batch: without
    # waiting for active sequences they alternate as two batches of four forever.
    sizes: list[int] = []

    async def scenario():
        batcher = _recording_batcher(sizes, max_batch_size=16, wait_s=1.0, busy_s=0.02)
        await asyncio.gather(*(_stream(batcher, f"s{i}", rounds=10, start_s=0.01 * (i >= 4), between_s=0.02)
                               for i in range(8)))

    asyncio.run(scenario())
    # The first batch runs before the second group exists, so that group ends a round later.
    assert sizes == [4] + [8] * 9 + [4], str(sizes)


@pytest.mark.parametrize("wait_for_active", [True, False])
def test_a_lone_stream_does_not_wait_for_company(wait_for_active):
    async def scenario():
        batcher = _recording_batcher([], max_batch_size=8, wait_s=30.0, wait_for_active=wait_for_active)
        # each call would take 30 s if the batcher waited for a second sequence
        await asyncio.wait_for(_stream(batcher, "only", rounds=3), timeout=5)

    asyncio.run(scenario())


@pytest.mark.parametrize("wait_s", [0.0, 0.05])
def test_without_active_waiting_a_batch_waits_for_as_many_calls_as_recent_batches(wait_s):
    sizes: list[int] = []

    async def scenario():
        batcher = _recording_batcher(sizes, max_batch_size=8, wait_s=wait_s, wait_for_active=False)
        await asyncio.gather(batcher.submit(("a", 0)), batcher.submit(("b", 0)))  # a batch of 2
        first = asyncio.create_task(batcher.submit(("a", 1)))
        await asyncio.sleep(0.005)          # the group's second call comes a little later
        await asyncio.gather(first, batcher.submit(("b", 1)))

    asyncio.run(scenario())
    assert sizes == ([2, 1, 1] if wait_s == 0 else [2, 2])


def test_a_released_sequence_is_not_waited_for():
    sizes: list[int] = []

    async def scenario():
        batcher = _recording_batcher(sizes, max_batch_size=8, wait_s=30.0)
        await asyncio.gather(batcher.submit(("done", 0)), batcher.submit(("going", 0)))
        batcher.release("done")
        await asyncio.wait_for(_stream(batcher, "going", rounds=3), timeout=5)

    asyncio.run(scenario())
    assert sizes == [2, 1, 1, 1]


def test_a_sequence_that_stops_calling_costs_one_window_once():
    wait_s = 1.0

    async def scenario() -> float:
        batcher = _recording_batcher([], max_batch_size=8, wait_s=wait_s)
        await asyncio.gather(batcher.submit(("gone", 0)), batcher.submit(("stays", 0)))
        started = time.monotonic()   # "gone" never calls again and is never released
        await _stream(batcher, "stays", rounds=4)
        return time.monotonic() - started

    # The first call waits out one window; waiting on every call would take 4 windows.
    assert wait_s <= asyncio.run(scenario()) < 2.5 * wait_s
