"""Timing a runner's forward pass on made-up sequences: the engine's cost profile and the
measured dtype choice both read it."""

from __future__ import annotations

import time

from replicas.engines.huggingface.model_runner import ExtendCall


def forward_ms(runner, count: int, new: int, context: int, repeats: int) -> float:
    """Median ms of one forward over `count` sequences computing `new` positions each on top
    of `context` cached ones (the first call, computing the contexts, is not timed)."""
    vocab = runner.vocab_size
    calls = [ExtendCall(f"_profile-{count}-{new}-{i}",
                        [(7 * i + 3 * j) % (vocab - 1) + 1 for j in range(context + new)], new)
             for i in range(count)]
    runner.extend_batch(calls)
    times = []
    for _ in range(repeats):                 # the last `new` positions of each, again
        started = time.perf_counter()
        runner.extend_batch(calls)
        times.append((time.perf_counter() - started) * 1000)
    for call in calls:
        runner.release(call.seq_id)
    return sorted(times)[len(times) // 2]
