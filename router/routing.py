"""How calls find pool replicas: cache affinity by sequence id.

The speculation loop passes each sequence's id as Serve's session id; with Serve's
consistent-hash request router on a pool, all calls of a sequence go to the replica that
holds its KV cache. When that replica is gone or at max_ongoing_requests, the router tries
the next replicas on the hash ring, which rebuild the cache from the call's token ids.
"""

from __future__ import annotations

from ray.serve.config import RequestRouterConfig

CACHE_AFFINITY = RequestRouterConfig(
    request_router_class="ray.serve.experimental.consistent_hash_router.ConsistentHashRouter",
    request_router_kwargs={"num_fallback_replicas": 2},
)
