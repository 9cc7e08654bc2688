"""A request's choices (n per prompt, router/admission.py), each a sequence of its own through
the pools: what each has produced, and their deltas merged as they come."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable

from replicas.protocol import TokenLogprobs
from router.speculation import Delta, Generation


class ChoiceOutput:
    """What one choice has produced so far."""

    def __init__(self, gen: Generation):
        self.gen = gen
        self.deltas = 0
        self.pieces: list[str] = [gen.echo] if gen.echo else []
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs] | None = None
        self.finish: str | None = None
        self.stop_reason: int | str | None = None

    def add(self, delta: Delta) -> None:
        self.deltas += 1
        self.pieces.append(delta.text)
        self.ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs or [])
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finish, self.stop_reason = delta.finish_reason, delta.stop_reason

    def text(self) -> str:
        return "".join(self.pieces)

    def mean_logprob(self) -> float:
        return sum(e.logprob for e in self.logprobs) / max(len(self.logprobs), 1)

    def text_length(self) -> int:
        return sum(map(len, self.pieces))


def best_of(outputs: list[ChoiceOutput], samples: int, n: int) -> list[ChoiceOutput]:
    """Of each prompt's `samples` choices (consecutive), the n with the highest mean logprob
    per token (OpenAI's "best"), best first; ties keep the order they were sampled in."""
    groups = [outputs[i:i + samples] for i in range(0, len(outputs), samples)]
    return [out for group in groups for out in sorted(group, key=lambda out: -out.mean_logprob())[:n]]


def prompt_tokens(gens: list[Generation], n: int) -> int:
    """Usage counts each prompt once, however many choices it has (as OpenAI and vLLM do)."""
    return sum(len(gen.prompt_ids) for gen in gens[::n])


async def interleaved(streams: list[AsyncIterator[Delta]], on_delta: Callable[[Delta, bool, float], None],
                      arrival: float) -> AsyncIterator[tuple[int, Delta]]:
    """(index, delta) from every stream as each delta comes; the first failure ends them all
    (each stream closed, which releases its caches). `on_delta(delta, first, last)` is told
    of each delta, with whether it is the request's first and when the one before came."""
    source = _indexed(streams[0]) if len(streams) == 1 else _merged(streams)
    last, first = arrival, True
    try:
        async for i, delta in source:
            on_delta(delta, first, last)
            last, first = time.monotonic(), False
            yield i, delta
    finally:
        await source.aclose()


async def _indexed(stream: AsyncIterator[Delta]) -> AsyncIterator[tuple[int, Delta]]:
    try:
        async for delta in stream:
            yield 0, delta
    finally:
        await stream.aclose()


async def _merged(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async for delta in stream:
                await queue.put((i, delta))
            await queue.put((i, done))
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
