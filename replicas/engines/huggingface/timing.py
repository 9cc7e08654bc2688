"""Timing a runner's forward pass on made-up sequences: the engine's start-up passes and the
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


# (rows, new positions each, cached context): enough to tell a pass's fixed cost from its cost
# per row and per position; small enough that a large model's start does not wait on them
# (a 1 B model computes about 7 positions a second on one core here): router/cost_model.py
# learns the rest, the attention's cost among it, from every call.
STARTUP_SHAPES = ((1, 1, 1), (1, 3, 1), (2, 1, 1), (2, 2, 1))
STARTUP_BUDGET_S = 5.0      # after a first round of the shapes, repeats stop once this is spent


def startup_passes(runner, shapes=STARTUP_SHAPES, repeats: int = 3,
                   budget_s: float = STARTUP_BUDGET_S) -> list[tuple[int, int, float, float]]:
    """Each shape's fastest of up to `repeats` passes, the shapes taken in turn within each
    repeat (a replica starting beside others meets their load in bursts: the fastest of
    passes spread over time is the least disturbed), as the engines report passes
    (replicas/protocol.py PassRecord). A large model's passes take a second each on a CPU:
    after the first round, repeats stop once `budget_s` is spent."""
    vocab = runner.vocab_size
    calls = {shape: [ExtendCall(f"_startup-{n}-{i}", [(7 * i + 3 * j) % (vocab - 1) + 1
                                                      for j in range(shape[2] + shape[1])], shape[1])
                     for i in range(shape[0])]
             for n, shape in enumerate(shapes)}
    for batch in calls.values():          # the contexts, computed once, not timed
        runner.extend_batch(batch)
    fastest = dict.fromkeys(shapes, float("inf"))
    began = time.perf_counter()
    for repeat in range(repeats):
        if repeat and time.perf_counter() - began > budget_s:
            break
        for shape, batch in calls.items():   # the last `new` positions of each, again
            started = time.perf_counter()
            runner.extend_batch(batch)
            fastest[shape] = min(fastest[shape], (time.perf_counter() - started) * 1000)
    for batch in calls.values():
        for call in batch:
            runner.release(call.seq_id)
    return [(rows, rows * new, rows * new * (context + new) / 1000, fastest[(rows, new, context)])
            for rows, new, context in shapes]
