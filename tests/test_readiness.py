"""Which pools answer, as a router sees them (router/readiness.py): a request waits at most
a probe's time for the target pool, the probes go on in the background until every pool has
answered once, and a pool that answered stays ready. The probe here is a plain coroutine
that answers after a set time, as a loading pool's describe call does; the HTTP behaviour on
a real cluster is tests/test_fresh_start.py's."""

from __future__ import annotations

import asyncio
import time

from router.readiness import PoolReadiness


class LoadingPools:
    """Pools whose describe answers once their load (seconds from now) is done."""

    def __init__(self, **load_s: float):
        self.ready_at = {pool: time.monotonic() + s for pool, s in load_s.items()}
        self.probes = 0

    async def probe(self, pool: str, timeout_s: float) -> None:
        self.probes += 1
        wait = self.ready_at[pool] - time.monotonic()
        if wait > timeout_s:
            await asyncio.sleep(timeout_s)
            raise asyncio.TimeoutError
        await asyncio.sleep(max(wait, 0))


def test_a_request_is_told_within_the_wait_whether_the_target_answers():
    async def scenario():
        pools = LoadingPools(target=3.0, draft=0.2)
        readiness = PoolReadiness(pools.probe, ["draft", "target"])
        started = time.monotonic()
        loading = await readiness.wait("target", 0.5)       # the target still loads: refused in 0.5 s
        refused_after = time.monotonic() - started
        await asyncio.sleep(0.3)
        draft_ready = readiness.is_ready("draft")           # found by the background probes meanwhile
        served = await readiness.wait("target", 5.0)        # it answers after its load
        return loading, refused_after, draft_ready, served, readiness.all_ready
    loading, refused_after, draft_ready, served, all_ready = asyncio.run(scenario())
    assert not loading and refused_after < 1.0
    assert draft_ready and served and all_ready


def test_a_router_whose_pools_long_answer_serves_its_first_request():
    async def scenario():
        pools = LoadingPools(target=0.0)
        readiness = PoolReadiness(pools.probe, ["target"])
        return await readiness.wait("target", 2.5), readiness.is_ready("target")
    assert asyncio.run(scenario()) == (True, True)


def test_probing_stops_once_every_pool_answered():
    async def scenario():
        pools = LoadingPools(target=0.0, draft=0.0)
        readiness = PoolReadiness(pools.probe, ["draft", "target"])
        readiness.watch()
        await asyncio.sleep(0.3)
        probes = pools.probes
        readiness.watch()                                    # nothing left to probe
        await asyncio.sleep(1.0)
        return probes, pools.probes
    before, after = asyncio.run(scenario())
    assert before == after == 2
