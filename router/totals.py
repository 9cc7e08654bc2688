"""Plain running totals of one router replica, for `specserve status` (apart from the
Prometheus exporter in router/metrics.py, which keeps no state of its own)."""

from __future__ import annotations

import time
from collections import deque

_WINDOW_S = 60.0


class Totals:
    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.requests = self.drafted = self.accepted = self.generated = 0
        self._recent: deque[tuple[float, int]] = deque()     # (when, tokens) of the last minute

    def round(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted

    def tokens(self, count: int) -> None:
        now = self.clock()
        self.generated += count
        self._recent.append((now, count))
        self._forget(now)

    def request(self, count: int = 1) -> None:
        self.requests += count

    def as_dict(self) -> dict:
        now = self.clock()
        self._forget(now)
        return {"requests": self.requests, "drafted": self.drafted, "accepted": self.accepted,
                "generated": self.generated,
                "tokens_per_s_last_minute": round(sum(n for _, n in self._recent) / _WINDOW_S, 2)}

    def _forget(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - _WINDOW_S:
            self._recent.popleft()
