"""How steady this machine's speed is, with nothing of specserve running: a single-threaded
float32 matrix multiply in a loop, counted per second and per 10-second block. Benchmark
ratios finer than the blocks' spread cannot be resolved by runs as long as a block.

    python -m experiments.machine_noise --seconds 60
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def per_second_counts(seconds: float, size: int = 256) -> list[int]:
    torch.set_num_threads(1)
    a = torch.randn(size, size)
    counts, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        started, count = time.monotonic(), 0
        while time.monotonic() - started < 1.0:
            a @ a
            count += 1
        counts.append(count)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60)
    counts = per_second_counts(parser.parse_args().seconds)
    mean = statistics.mean(counts)
    spread = statistics.stdev(counts) / mean if len(counts) > 1 else 0.0
    blocks = [sum(counts[i:i + 10]) for i in range(0, len(counts) - 9, 10)]
    print(f"multiplies a second: mean {mean:.0f}, coefficient of variation {spread:.3f}, "
          f"min {min(counts)}, max {max(counts)}")
    print(f"10-second blocks: {blocks}")


if __name__ == "__main__":
    main()
