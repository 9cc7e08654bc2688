"""How calls find pool replicas: cache affinity by lane.

The router gathers its sequences into lanes (router/gathering.py) and passes the lane as
Serve's session id; with Serve's consistent-hash request router on a pool, all calls of a
lane, and so of each of its sequences, go to the replica that holds their KV caches. When
that replica is gone or at max_ongoing_requests, the router tries the next replicas on the
hash ring, which rebuild the caches from the calls' token ids.
"""

from __future__ import annotations

import zlib

from ray.serve.config import RequestRouterConfig

from cluster.config import PoolsConfig

CACHE_AFFINITY = RequestRouterConfig(
    request_router_class="ray.serve.experimental.consistent_hash_router.ConsistentHashRouter",
    request_router_kwargs={"num_fallback_replicas": 2},
)
# Lanes are hashed onto replicas, so a few lanes per replica keep one replica from drawing
# most of them; every lane costs a call per round, so not more.
_LANES_PER_REPLICA = 4


def lane_count(pools: PoolsConfig) -> int:
    """Lanes for as many replicas as the pools may have (autoscaling's maximum)."""
    replicas = max(pools.draft.most_replicas, pools.target.most_replicas)
    return 1 if replicas == 1 else _LANES_PER_REPLICA * replicas


def lane_of(seq_id: str, lanes: int) -> str:
    """The session id of a sequence's calls; the same in every router process."""
    return lane_name(zlib.crc32(seq_id.encode()) % lanes)


def lane_name(index: int) -> str:
    return f"lane-{index}"
