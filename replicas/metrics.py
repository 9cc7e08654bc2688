"""A pool replica's Prometheus series, through Ray's metrics API (Serve adds the deployment,
so `draft` and `target` are told apart by its tag): specserve_queue_depth (sequences the
replica is serving), specserve_batch_size (calls per batched engine call),
specserve_cached_tokens, specserve_cache_evictions_total."""

from __future__ import annotations

from ray.serve.metrics import Counter, Gauge, Histogram

_SIZES = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]


class PoolMetrics:
    def __init__(self):
        self.queue_depth = Gauge("specserve_queue_depth", "Sequences this replica is serving")
        self.batch_size = Histogram("specserve_batch_size", "Calls per batched engine call", _SIZES)
        self.cached_tokens = Gauge("specserve_cached_tokens", "Positions held in this replica's KV caches")
        self.evictions = Counter("specserve_cache_evictions_total", "Sequences evicted from the KV caches")
        self._evictions_seen = 0

    def batch(self, calls: int, active_sequences: int, engine_state: dict) -> None:
        self.batch_size.observe(calls)
        self.queue_depth.set(active_sequences)
        self.cached_tokens.set(engine_state["cached_tokens"])
        new_evictions = engine_state["evictions"] - self._evictions_seen
        if new_evictions > 0:
            self.evictions.inc(new_evictions)
            self._evictions_seen = engine_state["evictions"]
