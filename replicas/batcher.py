"""Continuous batching of single calls for one model worker.

Calls queue up while the worker runs a batch; as soon as it is free it takes everything
queued (up to max_batch_size). It waits for more calls, at most `wait_s` after the first,
only while the batch is smaller than the largest of the recent batches: a lone stream never
waits, and a group of streams that moves in step is gathered whole. Batches therefore grow
with load by themselves. Serve's own `serve.batch` forms its
next batch while the previous one still runs, which splits the calls that queued behind a
busy model into several small batches; here the model being busy is what makes batches.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Awaitable, Callable, Generic, TypeVar

_RECENT_BATCHES = 16
Item = TypeVar("Item")
Result = TypeVar("Result")


class Batcher(Generic[Item, Result]):
    def __init__(self, run_batch: Callable[[list[Item]], Awaitable[list[Result]]],
                 max_batch_size: int, wait_s: float):
        self.run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.wait_s = wait_s
        self.batches = 0          # batches run, and the calls they carried: their mean is
        self.calls = 0            # the replica's mean batch size
        self._queue: asyncio.Queue[tuple[Item, asyncio.Future]] = asyncio.Queue()
        self._recent_sizes: deque[int] = deque(maxlen=_RECENT_BATCHES)
        self._consumer: asyncio.Task | None = None

    async def submit(self, item: Item) -> Result:
        if self._consumer is None or self._consumer.done():
            self._consumer = asyncio.create_task(self._consume())
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((item, future))
        return await future

    async def _consume(self) -> None:
        while True:
            batch = await self._collect()
            self.batches, self.calls = self.batches + 1, self.calls + len(batch)
            self._recent_sizes.append(len(batch))
            try:
                results = await self.run_batch([item for item, _ in batch])
            except Exception as exc:  # noqa: BLE001 - every caller in the batch gets the error
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():  # a caller that went away cancelled its future
                    future.set_result(result)

    async def _collect(self) -> list[tuple[Item, asyncio.Future]]:
        loop = asyncio.get_running_loop()
        batch = [await self._queue.get()]
        expected = max(self._recent_sizes, default=1)
        deadline = loop.time() + self.wait_s
        while len(batch) < self.max_batch_size:
            if not self._queue.empty():
                batch.append(self._queue.get_nowait())
                continue
            remaining = deadline - loop.time() if len(batch) < expected else 0
            if remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self._queue.get(), remaining))
            except asyncio.TimeoutError:
                break
        return batch
