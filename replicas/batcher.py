"""Continuous batching of the calls of many sequences for one model worker.

Calls queue while the worker runs a batch; as soon as it is free it takes everything queued
(up to max_batch_size). Then it may wait, at most `wait_s` after the batch's first call, for
more calls. What it waits for is one of two things:

- `wait_for_active=True`: the sequences it knows to be active. Each sequence calls once per
  round, so a sequence whose previous call this replica batched will call again until it is
  released. Without this, streams split into groups that alternate between the draft and the
  target pools and never meet (8 closed-loop streams gave verify batches of 3.35 on average,
  docs/BENCHMARKS.md). A sequence that misses a whole window is not waited for again until
  it calls again, so one that went away costs one window, once.
- otherwise: as many calls as the largest of the recent batches, so a group of streams that
  moves in step is gathered whole even when the router sends its calls a few ms apart.

Either way a new sequence never makes a batch wait, and neither does a lone stream. Only one
pool may wait for its active sequences: two pools that each wait for the sequences the
other one holds would stall each other until their windows expire (cluster/config.py).

Serve's own `serve.batch` forms its next batch while the previous one still runs, which
splits the calls that queued behind a busy model into several small batches; here the model
being busy is what makes batches.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable, Generic, Hashable, TypeVar

_RECENT_BATCHES = 16
Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass(frozen=True)
class _Failed:
    exc: Exception


class Batcher(Generic[Item, Result]):
    def __init__(self, run_batch: Callable[[list[Item]], Awaitable[list[Result]]],
                 key: Callable[[Item], Hashable], max_batch_size: int, wait_s: float,
                 wait_for_active: bool = False):
        self.run_batch = run_batch
        self.key = key                # the stream of calls a call belongs to (a sequence's)
        self.max_batch_size = max_batch_size
        self.wait_s = wait_s
        self.wait_for_active = wait_for_active
        self.batches = 0              # batches run, and the calls they carried: their mean is
        self.calls = 0                # the replica's mean batch size
        self.waited_s = 0.0           # summed time batches spent waiting for more calls
        self.missed_windows = 0       # batches whose window ran out before what they waited for
        self.isolation_reruns = 0     # failed batches rerun call by call to find the failing ones
        self._queue: deque[tuple[Item, asyncio.Future, float]] = deque()   # (call, its answer, arrival)
        self._queued_s: dict[asyncio.Future, float] = {}   # per call: its wait behind other batches
        self._active: set[Hashable] = set()   # sequences expected to call again
        self._recent_sizes: deque[int] = deque(maxlen=_RECENT_BATCHES)
        self._wakeup = asyncio.Event()        # a call arrived or a sequence was released
        self._consumer: asyncio.Task | None = None

    async def submit(self, item: Item) -> Result:
        return (await self.submit_timed(item))[0]

    async def submit_timed(self, item: Item) -> tuple[Result, float]:
        """The call's result and the seconds it queued while the worker ran other batches:
        time the worker was busy, not idle, which the router's cost model must not count as
        a round's overhead (router/cost_model.py)."""
        if self._consumer is None or self._consumer.done():
            self._consumer = asyncio.create_task(self._consume())
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.append((item, future, loop.time()))
        self._active.add(self.key(item))
        self._wakeup.set()
        try:
            return await future, self._queued_s.get(future, 0.0)
        finally:
            self._queued_s.pop(future, None)

    @property
    def active_sequences(self) -> int:
        """Sequences this batcher is serving: calls queued or running, and the sequences
        expected to call again (the signal the pool autoscales on)."""
        return len(self._active | {self.key(item) for item, _, _ in self._queue})

    def release(self, key: Hashable) -> None:
        """The sequence is finished: batches stop waiting for it."""
        self._active.discard(key)
        self._wakeup.set()

    async def _consume(self) -> None:
        while True:
            batch = await self._collect()
            self._recent_sizes.append(len(batch))
            self.batches, self.calls = self.batches + 1, self.calls + len(batch)
            results = await self._run_isolated([item for item, _ in batch])
            for (_, future), result in zip(batch, results, strict=True):
                if future.done():  # a caller that went away cancelled its future
                    continue
                if isinstance(result, _Failed):
                    future.set_exception(result.exc)
                else:
                    future.set_result(result)

    async def _run_isolated(self, items: list[Item]) -> list:
        """The batch's results; when the batch as a whole fails, each call is run alone, so
        that only the calls that fail alone get an error (a poison call must not fail the
        calls it happened to be batched with)."""
        try:
            return await self.run_batch(items)
        except Exception as exc:  # noqa: BLE001 - narrowed down below
            if len(items) == 1:
                return [_Failed(exc)]
        self.isolation_reruns += 1
        results = []
        for item in items:
            try:
                results.extend(await self.run_batch([item]))
            except Exception as exc:  # noqa: BLE001 - this call's own failure
                results.append(_Failed(exc))
        return results

    async def _collect(self) -> list[tuple[Item, asyncio.Future]]:
        while not self._queue:
            await self._wait_for_wakeup()
        loop = asyncio.get_running_loop()
        opened = loop.time()
        deadline = opened + self.wait_s
        batch: list[tuple[Item, asyncio.Future]] = []
        keys: set[Hashable] = set()
        while True:
            while self._queue and len(batch) < self.max_batch_size:
                item, future, arrived = self._queue.popleft()
                if arrived < opened:    # it came while the worker ran an earlier batch
                    self._queued_s[future] = opened - arrived
                batch.append((item, future))
                keys.add(self.key(item))
            if len(batch) == self.max_batch_size or self._complete(keys, len(batch)):
                break
            remaining = deadline - loop.time()
            if remaining <= 0 or not await self._wait_for_wakeup(remaining):
                # Missed the window: wait for those again only once they call again.
                self._active = keys | {self.key(item) for item, _, _ in self._queue}
                self.missed_windows += 1
                break
        self.waited_s += loop.time() - opened
        return batch

    def _complete(self, keys: set[Hashable], size: int) -> bool:
        if self.wait_for_active:
            return self._active <= keys
        return size >= max(self._recent_sizes, default=1)

    async def _wait_for_wakeup(self, timeout: float | None = None) -> bool:
        self._wakeup.clear()
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True
