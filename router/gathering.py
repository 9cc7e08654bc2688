"""Gathering at the router: one handle call per pool and lane for many sequences.

Every Serve call costs CPU at both ends; with one call per sequence per pool, 8 streams made
320 calls in a 2.7 s run, and the router, draft and target processes spent about 1.5 s of
their 3.1 s CPU on them (docs/BENCHMARKS.md). So the router sends the calls of its
sequences together: a lane's pending calls go out, one list per pool, as soon as none of the
lane's sequences is between calls. A sequence is between calls from the moment its previous
call's result is handed back (or it starts) until it makes its next call or finishes; that is
router-local work (emitting tokens), so the wait is short, and `wait_s` bounds it for a
sequence whose client stalls it. Sequences inside a call are never waited for: that is what
keeps the two pools from waiting on each other. The replicas still batch across lanes and
routers (replicas/batcher.py).

A lane is a group of sequences pinned to one replica per pool through Serve's session id
(router/routing.py): a sequence's lane follows from its id, so its calls keep reaching the
replicas that hold its caches.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

# send(pool, lane, requests) -> one result per request, in order
Send = Callable[[str, str, list], Awaitable[list]]
# How long a lane waits, once none of its sequences is between calls, for the other answers of
# a replica batch that is partly back (they reach the router as separate calls).
DEFAULT_LINGER_S = 0.002


@dataclass(frozen=True)
class _Call:
    seq_id: str
    request: Any
    future: asyncio.Future


@dataclass
class _Lane:
    between_calls: set[str] = field(default_factory=set)
    pending: dict[str, list[_Call]] = field(default_factory=lambda: defaultdict(list))
    in_flight: int = 0                 # calls sent and not yet answered
    timer: asyncio.TimerHandle | None = None


class CallGatherer:
    def __init__(self, send: Send, wait_s: float, abandoned: Callable[[str, str, str], None] = lambda *_: None,
                 linger_s: float = DEFAULT_LINGER_S):
        self.send = send
        self.wait_s = wait_s
        self.linger_s = linger_s
        # abandoned(pool, lane, seq_id): an answer came for a sequence that went away meanwhile;
        # the replica may have rebuilt its cache after the sequence's release.
        self.abandoned = abandoned
        self._lanes: dict[str, _Lane] = defaultdict(_Lane)

    def begin(self, lane: str, seq_id: str) -> None:
        """A new sequence: its first call is coming."""
        self._lanes[lane].between_calls.add(seq_id)

    def finish(self, lane: str, seq_id: str) -> None:
        """The sequence makes no more calls."""
        state = self._lanes[lane]
        state.between_calls.discard(seq_id)
        self._flush_if_ready(lane)

    async def call(self, pool: str, lane: str, seq_id: str, request) -> Any:
        state = self._lanes[lane]
        future = asyncio.get_running_loop().create_future()
        state.pending[pool].append(_Call(seq_id, request, future))
        state.between_calls.discard(seq_id)
        self._flush_if_ready(lane)
        return await future

    def _flush_if_ready(self, lane: str, lingered: bool = False) -> None:
        state = self._lanes[lane]
        if not any(state.pending.values()):
            return
        if state.between_calls:
            if state.timer is None:
                self._set_timer(lane, self.wait_s, self._flush)
        elif state.in_flight and not lingered:
            # The answers of one replica batch come back as separate calls, a moment apart:
            # going now would split the batch's sequences into groups for good.
            if state.timer is None or state.timer.when() > asyncio.get_running_loop().time() + self.linger_s:
                self._set_timer(lane, self.linger_s, lambda lane: self._flush_if_ready(lane, lingered=True))
        else:
            self._flush(lane)

    def _set_timer(self, lane: str, delay_s: float, then: Callable[[str], None]) -> None:
        state = self._lanes[lane]
        if state.timer is not None:
            state.timer.cancel()

        def fire() -> None:
            state.timer = None
            then(lane)
        state.timer = asyncio.get_running_loop().call_later(delay_s, fire)

    def _flush(self, lane: str) -> None:
        state = self._lanes[lane]
        if state.timer is not None:
            state.timer.cancel()
            state.timer = None
        for pool, calls in list(state.pending.items()):
            if calls:
                state.pending[pool] = []
                state.in_flight += 1
                # A fresh context: the task would otherwise inherit the Serve request context of
                # the sequence that happened to trigger the flush. Serve ties calls made inside a
                # request to it (and cancels them with it); sent so, a call shared by 8
                # sequences hung once that one request had ended.
                asyncio.create_task(self._send(pool, lane, calls), context=contextvars.Context())

    async def _send(self, pool: str, lane: str, calls: list[_Call]) -> None:
        try:
            results = await self.send(pool, lane, [call.request for call in calls])
        except BaseException as exc:  # noqa: BLE001 - every sequence of the call gets the error
            self._hand_back(lane, calls, [exc] * len(calls))
            if not isinstance(exc, Exception):
                raise
            return
        self._hand_back(lane, calls, results)
        for call in calls:
            if call.future.cancelled():
                self.abandoned(pool, lane, call.seq_id)

    def _hand_back(self, lane: str, calls: list[_Call], results: list) -> None:
        # All of them are between calls from now on, before the first one resumes: else its
        # next call would find the others not yet counted and go out alone.
        state = self._lanes[lane]
        state.in_flight -= 1
        live = [(call, result) for call, result in zip(calls, results, strict=True)
                if not call.future.done()]   # a sequence whose client went away cancelled it
        state.between_calls.update(call.seq_id for call, _ in live)
        for call, result in live:
            if isinstance(result, BaseException):
                call.future.set_exception(result)
            else:
                call.future.set_result(result)
