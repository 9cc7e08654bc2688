"""Calls from a router to its pools: transport, retries and cleanup.

A lane's gathered calls (router/gathering.py) go over the lane's direct channel to the
replica that serves it (router/direct_routes.py) or, until that is known and whenever it
breaks, by Serve handle. The draft pool is optional: a draft call gets one attempt within
the draft budget (a late draft is no draft; router/fallback.py stops asking a pool that
failed). The target pool is not: a verify call whose replica died is retried on another
replica until the pool's call timeout; one not answered by then fails its sequences with
TargetTimeout.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass

from ray.exceptions import RayActorError
from ray.serve.exceptions import ReplicaUnavailableError

from replicas.direct_channel import ChannelBroken
from router.direct_routes import DirectRoutes

logger = logging.getLogger("ray.serve")
# A call whose replica died is retried until Serve has noticed and routes elsewhere, or has
# replaced the replica (seconds; a tensor-parallel replica restarts all its shards).
_RETRY_BACKOFF_S = 0.1
_LONGEST_RETRY_PAUSE_S = 2.0
_METHODS = {"draft": "propose", "target": "verify"}


class TargetTimeout(Exception):
    """A verify call was not answered within the target pool's call timeout."""


class TargetUnavailable(Exception):
    """Every attempt of a verify call found its replica dead."""


@dataclass(frozen=True)
class PoolTimeouts:
    draft_s: float             # the draft budget: later drafts are not waited for
    target_s: float


class PoolClient:
    def __init__(self, draft, target, timeouts: PoolTimeouts, channel_key: bytes | None = None):
        # DeploymentHandles of the pools, by value: a call goes to the replica directly
        # instead of through the object store, 4.96 -> 3.75 ms median per call here
        # (docs/BENCHMARKS.md). No draft pool (draft None): the cluster drafts by lookup only.
        self.pools = {pool: handle.options(_by_reference=False)
                      for pool, handle in (("draft", draft), ("target", target)) if handle is not None}
        # Faster still: the calls of a round over direct channels to the same replicas (about
        # 0.75 ms against 4.3-4.8 ms a handle call, docs/BENCHMARKS.md); handles carry the rest.
        self.routes = DirectRoutes(channel_key, self._channel_address) if channel_key is not None else None
        self.timeouts = timeouts
        self.call_paths: Counter[str] = Counter()   # pool calls sent "direct" and by "handle"
        self.retries: Counter[str] = Counter()      # per sequence: calls repeated after a replica died

    def has(self, pool: str) -> bool:
        return pool in self.pools

    async def send(self, pool: str, lane: str, requests: list) -> list:
        """One call to a pool with the requests of a lane: over the lane's direct channel when
        there is one, else (or when it breaks) by handle."""
        budget_s = self.timeouts.draft_s if pool == "draft" else self.timeouts.target_s
        give_up_at = time.monotonic() + budget_s
        client = self.routes.client(pool, lane) if self.routes is not None else None
        if client is not None:
            try:
                results = await asyncio.wait_for(client.call(_METHODS[pool], requests), budget_s)
                self.call_paths["direct"] += 1
                return results
            except ChannelBroken:
                logger.info("the direct channel to the %s pool broke; this call goes by handle", pool)
                self.routes.forget(pool, lane)
                if pool == "target":   # it may have died with the replica: this is its retry
                    self.retries.update(request.seq_id for request in requests)
            except asyncio.TimeoutError:
                if pool == "draft":
                    raise
                raise TargetTimeout(f"the target pool did not answer within {budget_s:g} s") from None
        self.call_paths["handle"] += 1
        if pool == "draft":
            remaining = max(give_up_at - time.monotonic(), 0.001)
            return await within(self.lane_handle(pool, lane).propose.remote(requests), remaining)
        return await self._verify(lane, requests, give_up_at)

    async def _verify(self, lane: str, requests: list, give_up_at: float) -> list:
        """When the replica died, retry with backoff until Serve routes the call to another
        replica, or has replaced the dead one (a tensor-parallel replica restarts whole); the
        requests carry all their state, so any replica can answer them. Retries and all take
        at most the pool's call timeout."""
        method = self.lane_handle("target", lane).verify
        for attempt in itertools.count():
            try:
                return await within(method.remote(requests), max(give_up_at - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                raise TargetTimeout(f"the target pool did not answer within {self.timeouts.target_s:g} s") from None
            except (RayActorError, ReplicaUnavailableError) as exc:
                if time.monotonic() >= give_up_at:
                    raise TargetUnavailable(f"no target replica could serve the call ({type(exc).__name__})") from None
                self.retries.update(request.seq_id for request in requests)
                logger.warning("replica died during a verify call; retrying (attempt %d)", attempt + 2)
                await asyncio.sleep(min(_RETRY_BACKOFF_S * 2 ** attempt, _LONGEST_RETRY_PAUSE_S))

    async def describe(self, pool: str, timeout_s: float) -> dict:
        return await within(self.pools[pool].describe.remote(), timeout_s)

    async def _channel_address(self, pool: str, lane: str) -> tuple[str, int]:
        return await within(self.lane_handle(pool, lane).channel_address.remote(), 10.0)

    @functools.cache
    def lane_handle(self, pool: str, lane: str):
        return self.pools[pool].options(session_id=lane)

    def release(self, lane: str, seq_id: str, *pools: str) -> None:
        """Free the sequence's caches; not awaited, since nothing depends on it. Sent from a
        fresh context: Serve cancels the calls a cancelled request (a client that went away)
        makes, and these are made as it unwinds."""
        for pool in (pool for pool in pools if pool in self.pools):
            try:
                contextvars.Context().run(self.lane_handle(pool, lane).release.remote, seq_id)
            except Exception:  # noqa: BLE001 - a failed cleanup only costs cache space (LRU)
                logger.warning("could not release caches of %s", seq_id, exc_info=True)


async def within(response, timeout_s: float):
    """Await a DeploymentResponse for at most timeout_s; cancel the call when it is late."""
    async def result():
        return await response
    try:
        return await asyncio.wait_for(result(), timeout_s)
    except asyncio.TimeoutError:
        response.cancel()
        raise
