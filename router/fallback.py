"""Degradation to the target alone when the draft pool cannot serve.

Speculation only ever saves time; the target alone gives the same greedy tokens and the same
sampled distribution (a round with k = 0 is a plain target step). So when a propose call
fails (every replica dead, none placeable, the replica died mid-call) or takes longer than
the pool's budget, its sequences verify without drafts for that round, and the router stops
asking the draft pool: every sequence rounds with k = 0 until a probe (a cheap `describe`
call, tried with growing pauses) finds the pool answering again. So a lost draft pool costs
each sequence at most one budget of waiting, not one per round, and clients see no error.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Awaitable, Callable

logger = logging.getLogger("ray.serve")
_FIRST_PROBE_S = 0.25
_LONGEST_PROBE_PAUSE_S = 4.0


class DraftAvailability:
    def __init__(self, probe: Callable[[], Awaitable], probe_timeout_s: float):
        self._probe = probe                    # answers when a draft replica does
        self._probe_timeout_s = probe_timeout_s
        self._prober: asyncio.Task | None = None
        self.outages = 0                       # times the pool was found unable to serve
        self.down_since: float | None = None

    @property
    def available(self) -> bool:
        return self._prober is None

    def report_failure(self, reason: str) -> None:
        """A propose call failed or ran over its budget: round without drafts until a probe
        succeeds. Idempotent while the pool is down."""
        if self._prober is not None:
            return
        self.outages += 1
        self.down_since = time.monotonic()
        logger.warning("draft pool unavailable (%s): sequences continue with the target alone", reason)
        # A fresh context: the probe outlives the request whose round noticed the failure,
        # and Serve cancels the calls a finished request made.
        self._prober = asyncio.get_running_loop().create_task(self._probe_until_back(),
                                                              context=contextvars.Context())

    async def _probe_until_back(self) -> None:
        pause = _FIRST_PROBE_S
        while True:
            await asyncio.sleep(pause)
            try:
                await asyncio.wait_for(self._probe(), self._probe_timeout_s)
                break
            except Exception as exc:  # noqa: BLE001 - any failure means: not back yet
                logger.info("draft pool still unavailable: %s", type(exc).__name__)
                pause = min(pause * 2, _LONGEST_PROBE_PAUSE_S)
        logger.warning("draft pool answers again after %.1f s: speculating again",
                       time.monotonic() - self.down_since)
        self._prober = None
