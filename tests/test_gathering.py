"""Router-side gathering: the calls of a lane's sequences go out together once none of them is
between calls, never wait for a sequence inside a call, and a stalled or vanished sequence
does not hold the others."""

from __future__ import annotations

import asyncio

import pytest

from router.gathering import CallGatherer


class Pools:
    """A stand-in for the two pools' handles: records each call's size, answers after a delay."""

    def __init__(self, delay_s: float = 0.005, fail_on: int | None = None):
        self.sizes: dict[str, list[int]] = {"draft": [], "target": []}
        self.delay_s, self.fail_on = delay_s, fail_on

    async def send(self, pool: str, lane: str, requests: list[int]) -> list[int]:
        self.sizes[pool].append(len(requests))
        await asyncio.sleep(self.delay_s)
        if self.fail_on in requests:
            raise ValueError("bad request")
        return [r * 10 for r in requests]


async def _sequence(gatherer: CallGatherer, name: str, rounds: int, start_s: float = 0.0, emit_s: float = 0.0):
    """One sequence's rounds; it must have begun (`gatherer.begin`) unless start_s > 0."""
    if start_s:
        await asyncio.sleep(start_s)
        gatherer.begin("lane", name)
    try:
        for r in range(rounds):
            assert await gatherer.call("draft", "lane", name, r) == r * 10
            assert await gatherer.call("target", "lane", name, r) == r * 10
            await asyncio.sleep(emit_s)   # router-local work: emitting the round's tokens
    finally:
        gatherer.finish("lane", name)


def _begun(gatherer: CallGatherer, *names: str) -> CallGatherer:
    for name in names:
        gatherer.begin("lane", name)
    return gatherer


def test_sequences_in_step_share_one_call_per_pool_and_round():
    pools = Pools()

    async def scenario():
        gatherer = _begun(CallGatherer(pools.send, wait_s=5.0), *(f"s{i}" for i in range(8)))
        await asyncio.gather(*(_sequence(gatherer, f"s{i}", rounds=5, emit_s=0.001 * i) for i in range(8)))

    asyncio.run(scenario())
    assert pools.sizes == {"draft": [8] * 5, "target": [8] * 5}


def test_a_late_sequence_does_not_wait_for_those_inside_a_call():
    pools = Pools(delay_s=0.05)

    async def scenario():
        gatherer = _begun(CallGatherer(pools.send, wait_s=30.0), *(f"s{i}" for i in range(4)))
        # "late" starts while the first group's draft call is out: it goes alone, at once
        await asyncio.wait_for(asyncio.gather(*(_sequence(gatherer, f"s{i}", rounds=3) for i in range(4)),
                                              _sequence(gatherer, "late", rounds=3, start_s=0.01)), timeout=5)

    asyncio.run(scenario())
    assert pools.sizes["draft"][:2] == [4, 1]


def test_a_stalled_sequence_holds_the_others_for_one_window_at_most():
    pools = Pools(delay_s=0.0)

    async def scenario():
        gatherer = _begun(CallGatherer(pools.send, wait_s=0.05), "stalled", "quick")
        stalled = asyncio.create_task(_sequence(gatherer, "stalled", rounds=2, emit_s=10.0))
        await asyncio.wait_for(_sequence(gatherer, "quick", rounds=2), timeout=2)
        stalled.cancel()

    asyncio.run(scenario())


def test_a_sequence_whose_client_went_away_is_not_waited_for():
    pools = Pools(delay_s=0.02)

    async def scenario():
        gatherer = _begun(CallGatherer(pools.send, wait_s=30.0), "gone", "stays")
        gone = asyncio.create_task(_sequence(gatherer, "gone", rounds=100))
        stays = asyncio.create_task(_sequence(gatherer, "stays", rounds=5))
        await asyncio.sleep(0.01)
        gone.cancel()                 # while its first call is out
        await asyncio.wait_for(stays, timeout=5)

    asyncio.run(scenario())


def test_an_error_reaches_every_sequence_of_the_call_and_the_lane_goes_on():
    pools = Pools(fail_on=13)

    async def scenario():
        gatherer = CallGatherer(pools.send, wait_s=1.0)
        gatherer.begin("lane", "a")
        gatherer.begin("lane", "b")
        results = await asyncio.gather(gatherer.call("target", "lane", "a", 1),
                                       gatherer.call("target", "lane", "b", 13), return_exceptions=True)
        gatherer.finish("lane", "b")
        return results, await asyncio.wait_for(gatherer.call("target", "lane", "a", 2), timeout=2)

    results, after = asyncio.run(scenario())
    assert all(isinstance(r, ValueError) for r in results) and after == 20
    assert pools.sizes["target"] == [2, 1]


@pytest.mark.parametrize("pool_order", [("draft", "target"), ("target", "draft")])
def test_calls_to_both_pools_wait_for_the_same_lane(pool_order):
    # A sequence in its last round skips the draft pool: its verify call and the others'
    # propose calls still leave together, each to its own pool.
    pools = Pools()

    async def scenario():
        gatherer = CallGatherer(pools.send, wait_s=5.0)
        gatherer.begin("lane", "x")
        gatherer.begin("lane", "y")
        return await asyncio.gather(gatherer.call(pool_order[0], "lane", "x", 1),
                                    gatherer.call(pool_order[1], "lane", "y", 2))

    assert asyncio.run(scenario()) == [10, 20]
    assert pools.sizes == {"draft": [1], "target": [1]}


def test_a_finished_sequence_is_not_waited_for():
    pools = Pools()

    async def scenario():
        gatherer = _begun(CallGatherer(pools.send, wait_s=30.0), "short", "long")
        await asyncio.wait_for(asyncio.gather(_sequence(gatherer, "short", rounds=1),
                                              _sequence(gatherer, "long", rounds=4)), timeout=5)

    asyncio.run(scenario())
    assert pools.sizes["draft"] == [2, 1, 1, 1]


def test_answers_of_one_replica_batch_that_come_back_apart_go_out_together_again():
    # The replica answered both draft calls from one forward pass, but its answers reach the
    # router as two calls 1 ms apart: the next round still makes one call for all four. The
    # linger is far longer than the gap, so a slow machine's scheduling cannot split them.
    sizes: dict[str, list[int]] = {"draft": [], "target": []}
    both_arrived = asyncio.Event()

    async def send(pool: str, lane: str, requests: list[int]) -> list[int]:
        sizes[pool].append(len(requests))
        if pool == "draft":
            if len(sizes["draft"]) == 2:
                both_arrived.set()
                await asyncio.sleep(0.001)
            await both_arrived.wait()
        return [r * 10 for r in requests]

    async def scenario():
        gatherer = _begun(CallGatherer(send, wait_s=5.0, linger_s=0.5), "a", "b", "c")
        group = [asyncio.create_task(_sequence(gatherer, name, rounds=1)) for name in "abc"]
        await asyncio.sleep(0)                      # their draft call is out
        await asyncio.wait_for(asyncio.gather(*group, _sequence(gatherer, "d", rounds=1, start_s=1e-4)), 5)

    asyncio.run(scenario())
    assert sizes == {"draft": [3, 1], "target": [4]}


def test_an_answer_for_a_sequence_that_went_away_is_reported():
    # Its release may have reached the replica before the call did, which then rebuilt the
    # cache: the router is told, so that it can release it again.
    pools, abandoned = Pools(delay_s=0.02), []

    async def scenario():
        gatherer = _begun(CallGatherer(pools.send, wait_s=1.0, abandoned=lambda *args: abandoned.append(args)),
                          "gone")
        gone = asyncio.create_task(_sequence(gatherer, "gone", rounds=3))
        await asyncio.sleep(0.005)
        gone.cancel()                 # while its draft call is out
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert abandoned == [("draft", "lane", "gone")]
