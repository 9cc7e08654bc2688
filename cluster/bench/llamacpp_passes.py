"""The llama.cpp engine's runner alone (replicas/engines/llamacpp/runner.py): what a pass of R
sequences x one new position costs, with F finished sequences' cells held in its cache.

    python -m cluster.bench.llamacpp_passes --gguf models/gguf/target.gguf --finished 150 \\
        --retired-kept 150 8 --rows 1 8 16 32

Each finished sequence is a distinct random prompt of --finished-tokens, computed and retired
(so its cells stay, up to --retired-kept of them); then, for each row count, that many live
sequences of --context positions take --steps single-token steps together, timed (median).
Why it matters: llama.cpp's attention visits every cell up to the highest in use for each new
position, so held cells cost every pass (docs/ENGINES.md). No Ray, no server.

    python -m cluster.bench.llamacpp_passes --gguf FILE.gguf --threads 2 --lone

--lone measures instead what exactness costs a lone sequence: its single-token step as the
runner takes it (a window of two, llama.cpp's matrix-matrix kernels) against one position
alone (its matrix-vector path, what llama-server runs), median ms of each, interleaved.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from replicas.engines.huggingface.model_runner import ExtendCall
from replicas.engines.llamacpp.runner import LlamaCppRunner


def pass_ms(runner: LlamaCppRunner, rows: int, context: int, steps: int, rng: random.Random) -> float:
    """Median ms of a pass of `rows` live sequences x one new position."""
    sequences = {f"live{rows}-{i}": [rng.randrange(3, runner.vocab_size) for _ in range(context)] for i in range(rows)}
    runner.extend_batch([ExtendCall(name, tokens, 1) for name, tokens in sequences.items()])
    times = []
    for _ in range(steps):
        for tokens in sequences.values():
            tokens.append(rng.randrange(3, runner.vocab_size))
        started = time.perf_counter()
        runner.extend_batch([ExtendCall(name, tokens, 1) for name, tokens in sequences.items()])
        times.append((time.perf_counter() - started) * 1000)
    for name in sequences:
        runner.release(name)
    return statistics.median(times)


def measure(gguf: Path, threads: int, finished: int, finished_tokens: int, retired_kept: int,
            rows: list[int], context: int, steps: int) -> list[dict]:
    runner = LlamaCppRunner(gguf, 32768, max(context + steps + 1, finished_tokens), max_sequences=256,
                            threads=threads, retired_kept=retired_kept)
    rng = random.Random(0)
    for i in range(finished):
        runner.extend_batch([ExtendCall(f"done{i}", [rng.randrange(3, runner.vocab_size)
                                                      for _ in range(finished_tokens)], 1)])
        runner.retire(f"done{i}")
    held = runner.describe()["retired_sequences"]
    results = [{"retired_kept": retired_kept, "finished_held": held, "rows": r,
                "pass_ms": round(pass_ms(runner, r, context, steps, rng), 2)} for r in rows]
    runner.close()
    return results


def lone_step_ms(gguf: Path, threads: int, context: int, steps: int) -> dict:
    """Median ms of one sequence's single-token step, as a window of two and as one position,
    the two taken in turn on the same sequence so that the machine's drift hits both."""
    rng = random.Random(0)
    runners = {window: LlamaCppRunner(gguf, 4096, context + steps + 2, max_sequences=4, threads=threads,
                                      lone_step_window=window) for window in (True, False)}
    tokens = [rng.randrange(3, runners[True].vocab_size) for _ in range(context)]
    for runner in runners.values():
        runner.extend_batch([ExtendCall("lone", tokens, 1)])
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(steps):
        tokens.append(rng.randrange(3, runners[True].vocab_size))
        for window, runner in runners.items():
            started = time.perf_counter()
            runner.extend_batch([ExtendCall("lone", tokens, 1)])
            times[window].append((time.perf_counter() - started) * 1000)
    for runner in runners.values():
        runner.close()
    return {"threads": threads, "context": context, "window_of_two_ms": round(statistics.median(times[True]), 2),
            "one_position_ms": round(statistics.median(times[False]), 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=Path("models/gguf/target.gguf"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--finished", type=int, default=150, help="finished sequences to retire first")
    parser.add_argument("--finished-tokens", type=int, default=200)
    parser.add_argument("--retired-kept", type=int, nargs="+", default=[150, 8],
                        help="the runner's retired_kept, one measurement each")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--lone", action="store_true", help="a lone sequence's step: window of two vs one position")
    args = parser.parse_args(argv)
    if args.lone:
        print(lone_step_ms(args.gguf, args.threads, args.context, args.steps), flush=True)
        return 0
    for kept in args.retired_kept:
        for result in measure(args.gguf, args.threads, args.finished, args.finished_tokens, kept, args.rows,
                              args.context, args.steps):
            print(result, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
