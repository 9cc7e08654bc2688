"""`dtype: auto` on a CPU: the faster of the checkpoint's reduced precision and float32, measured.

Which of the two runs a model faster is a property of the CPU, not of the dtype. On one CPU
here bfloat16 ran the bundled target's forward at 1.0-2.1x float32's speed; on another (with
AMX, 2026-12-03) float32 ran at 1.0-1.9x bfloat16's for 1 to 16 sequences; on a third, a
cluster in bfloat16 served the target alone at 0.6x its float32 speed at one client
(docs/BENCHMARKS.md). So where `auto` may take either, the replica times both runners on the
shapes its pool serves and keeps the faster; a GPU keeps the checkpoint's dtype.

The score of a runner is the geometric mean, over those shapes, of its median forward time:
every shape counts alike, whichever one is the slowest in absolute terms, because a replica
serves one sequence at night and a full batch at noon.
"""

from __future__ import annotations

import math

from replicas.engines.huggingface.timing import forward_ms

POSITIONS = (1, 5)      # a decode step and a verify of four drafts
CONTEXT = 64            # cached positions under each timed sequence
REPEATS = 5


def faster(runners: dict[str, object], max_rows: int) -> tuple[str, dict[str, float]]:
    """The name of the runner with the least geometric-mean forward time over rows (1,
    max_rows) x POSITIONS, and each runner's score in ms. The runners take turns shape by
    shape, so a drift of the machine's speed during the measurement falls on both."""
    shapes = [(rows, new) for rows in sorted({1, max_rows}) for new in POSITIONS]
    logs = {name: 0.0 for name in runners}
    for rows, new in shapes:
        for name, runner in runners.items():
            logs[name] += math.log(forward_ms(runner, rows, new, CONTEXT, REPEATS))
    scores = {name: round(math.exp(total / len(shapes)), 3) for name, total in logs.items()}
    return min(scores, key=scores.get), scores
