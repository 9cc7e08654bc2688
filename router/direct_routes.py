"""Which direct channel carries a lane's calls to a pool (replicas/direct_channel.py).

Serve still decides which replica serves a lane: the router asks it, through a handle whose
session id is the lane (router/routing.py), for the `channel_address` of that replica, so a
lane's direct calls reach the replica that holds its caches, as its handle calls would.
The answer is asked again every ROUTE_TTL_S in the background, which follows replicas that
Serve added, moved or replaced. Until a lane's route is known, and whenever its channel
breaks, its calls take the handle path (which retries on another replica); one connection
per replica is shared by all the lanes that route to it.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Awaitable, Callable

from replicas.direct_channel import ChannelClient

logger = logging.getLogger("ray.serve")
ROUTE_TTL_S = 2.0

# resolve(pool, lane) -> (host, port) of the replica serving the lane
Resolve = Callable[[str, str], Awaitable[tuple[str, int]]]


class DirectRoutes:
    def __init__(self, key: bytes, resolve: Resolve, ttl_s: float = ROUTE_TTL_S):
        self.key, self.resolve, self.ttl_s = key, resolve, ttl_s
        self._routes: dict[tuple[str, str], tuple[tuple[str, int], float]] = {}   # -> (address, resolved at)
        self._clients: dict[tuple[str, int], ChannelClient] = {}
        self._resolving: set[tuple[str, str]] = set()

    def client(self, pool: str, lane: str) -> ChannelClient | None:
        """The lane's channel, when its route is known and its connection not broken; asks
        for the route (again) in the background when it is unknown or due."""
        route = self._routes.get((pool, lane))
        if route is None or time.monotonic() - route[1] > self.ttl_s:
            self._resolve_later(pool, lane)
        if route is None:
            return None
        client = self._clients.get(route[0])
        if client is None or client.broken:
            self.forget(pool, lane)
            return None
        return client

    def forget(self, pool: str, lane: str) -> None:
        """The lane's channel failed: its calls take the handle path until a new route comes."""
        route = self._routes.pop((pool, lane), None)
        if route is not None:
            client = self._clients.get(route[0])
            if client is not None and client.broken:
                del self._clients[route[0]]

    def _resolve_later(self, pool: str, lane: str) -> None:
        if (pool, lane) in self._resolving:
            return
        self._resolving.add((pool, lane))
        # A fresh context: the lookup outlives the request whose call asked for it.
        asyncio.get_running_loop().create_task(self._resolve(pool, lane), context=contextvars.Context())

    async def _resolve(self, pool: str, lane: str) -> None:
        try:
            address = tuple(await self.resolve(pool, lane))
        except Exception:  # noqa: BLE001 - asked again at the lane's next call
            logger.info("no direct route to the %s pool for lane %s yet", pool, lane, exc_info=True)
            return
        finally:
            self._resolving.discard((pool, lane))
        if address not in self._clients or self._clients[address].broken:
            self._clients[address] = ChannelClient(self.key, address)
        self._routes[(pool, lane)] = (address, time.monotonic())

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
