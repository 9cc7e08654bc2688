"""Whether each pool has a replica that answers, as this router sees it.

A router starts before its pools' models have loaded (a large target takes minutes), and a
handle call to a pool without a running replica waits until one runs. So until the target
pool has answered once, generation requests are refused at once with 503 and Retry-After
(a client or balancer tries again, or another router) instead of waiting for the load or a
deadline; /ready says the same. Until the draft pool has answered, rounds draft by lookup or
not at all (router/draft_sources.py), as when it fails later. Once a pool has answered it
counts as ready for good: a replica that dies later is what retries (router/pool_client.py)
and draft fallback (router/fallback.py) are for.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging

logger = logging.getLogger("ray.serve")
_PROBE_TIMEOUT_S = 2.0
_PROBE_PAUSE_S = 0.5
FIRST_ANSWER_WAIT_S = 2.5     # a request waits this long for a probe before it is refused


class PoolReadiness:
    def __init__(self, probe, pools: list[str]):
        """probe(pool, timeout_s): awaits a pool's answer (its describe call)."""
        self._probe = probe
        self.ready = {pool: False for pool in pools}
        self._answered = {pool: asyncio.Event() for pool in pools}
        self._watch: asyncio.Task | None = None

    def is_ready(self, pool: str) -> bool:
        return self.ready.get(pool, False)

    @property
    def all_ready(self) -> bool:
        return all(self.ready.values())

    def watch(self) -> None:
        """Start probing the pools not yet ready, in the background (idempotent; from a fresh
        context: it outlives the request that started it)."""
        if self.all_ready or (self._watch is not None and not self._watch.done()):
            return
        self._watch = asyncio.get_running_loop().create_task(self._until_ready(), context=contextvars.Context())

    async def wait(self, pool: str, timeout_s: float) -> bool:
        """Whether `pool` answers, waiting at most timeout_s for the probes to find out (a
        router's first request, its pools long loaded, is not refused for want of a probe)."""
        if self.is_ready(pool):
            return True
        self.watch()
        try:
            await asyncio.wait_for(self._answered[pool].wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    async def _until_ready(self) -> None:
        while not self.all_ready:
            for pool in [pool for pool, ready in self.ready.items() if not ready]:
                try:
                    await self._probe(pool, _PROBE_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - not answering yet: loading, or not placed yet
                    continue
                self.ready[pool] = True
                self._answered[pool].set()
                logger.info("the %s pool answers: ready", pool)
            if not self.all_ready:
                await asyncio.sleep(_PROBE_PAUSE_S)
