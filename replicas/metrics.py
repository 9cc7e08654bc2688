"""A pool replica's Prometheus series, through Ray's metrics API (Serve adds the deployment,
so `draft` and `target` are told apart by its tag): specserve_queue_depth (sequences the
replica is serving), specserve_batch_size (calls per batched engine call),
specserve_cached_tokens, specserve_cache_evictions_total.

Ray's metrics agent drops a gauge that was not set again within two export intervals, so
gauges are set again every few seconds (`refresh_every`), traffic or not."""

from __future__ import annotations

import logging
import threading
from typing import Callable

from ray.serve.metrics import Counter, Gauge, Histogram

logger = logging.getLogger("ray.serve")
GAUGE_REFRESH_S = 2.0


def refresh_every(seconds: float, refresh: Callable[[], None]) -> None:
    """Call `refresh` every `seconds` on a daemon thread, for the life of the process."""
    def loop() -> None:
        while not stop.wait(seconds):
            try:
                refresh()
            except Exception:  # noqa: BLE001 - a metric not refreshed is not worth a replica
                logger.warning("could not refresh gauges", exc_info=True)
    stop = threading.Event()
    threading.Thread(target=loop, name="specserve-gauges", daemon=True).start()

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
        self.state(active_sequences, engine_state)

    def state(self, active_sequences: int, engine_state: dict) -> None:
        self.queue_depth.set(active_sequences)
        self.cached_tokens.set(engine_state["cached_tokens"])
        new_evictions = engine_state["evictions"] - self._evictions_seen
        if new_evictions > 0:
            self.evictions.inc(new_evictions)
            self._evictions_seen = engine_state["evictions"]
