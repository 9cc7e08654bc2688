"""Verify latency of one model at tp_size 1 and 2: the forward pass a target replica runs per
round (k + 1 new positions per sequence on top of a cached context), timed on the runner
itself, without Serve.

    python -m experiments.tp_verify --model models/target --batch 1 8 --k 4 --context 128

tp 1 runs in this process with 1 and with 2 threads; tp 2 runs two shards of 1 thread each
(this process is rank 0, the other a local process), so both use the same two cores.
Results: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from cluster.config import ModelSpec
from replicas.engines.huggingface.model_runner import ExtendCall


def verify_ms(runner, batch: int, k: int, context: int, repeats: int) -> float:
    """Median wall time of a batched verify: k + 1 positions per row over `context` cached."""
    rows = {f"s{b}": [(7 * b + 3 * i) % 400 + 1 for i in range(context + k)] for b in range(batch)}
    calls = [ExtendCall(seq_id, tokens, k + 1) for seq_id, tokens in rows.items()]
    runner.extend_batch(calls)          # caches the contexts; every later call recomputes k + 1
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        runner.extend_batch(calls)
        times.append((time.perf_counter() - started) * 1000)
    for seq_id in rows:
        runner.release(seq_id)
    return round(statistics.median(times), 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("models/target"))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)

    from replicas.engines.huggingface.loading import load_causal_lm
    from replicas.engines.huggingface.model_runner import ModelRunner
    from replicas.engines.huggingface.shard_group import launch_local

    spec = ModelSpec(path=args.model.resolve())
    single = ModelRunner(load_causal_lm(spec), max_cached_tokens=1 << 20)
    sharded = launch_local(spec, max_cached_tokens=1 << 20, world=2)
    results = []
    try:
        for batch in args.batch:
            row = {"batch": batch, "k": args.k, "context": args.context}
            for threads in (1, 2):
                torch.set_num_threads(threads)
                row[f"tp1_{threads}_threads_ms"] = verify_ms(single, batch, args.k, args.context, args.repeats)
            torch.set_num_threads(1)
            row["tp2_ms"] = verify_ms(sharded, batch, args.k, args.context, args.repeats)
            results.append(row)
            print(json.dumps(row), flush=True)
    finally:
        sharded.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
