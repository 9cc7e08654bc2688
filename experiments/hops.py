"""The cost of one call between deployments, the unit of a round's coordination cost.

    python -m experiments.hops --calls 300

Starts a local Ray, deploys an echo deployment and a caller, and reports the caller's median
latency per call for each handle option (payload: a request-sized dict of 300 token ids).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ray import serve

OPTIONS = {
    "by_reference": {},
    "by_reference_session": {"session_id": "s"},
    "by_value": {"_by_reference": False},
    "by_value_session": {"_by_reference": False, "session_id": "s"},
}


@serve.deployment(max_ongoing_requests=64)
class Echo:
    async def echo(self, payload):
        return payload


@serve.deployment
class Caller:
    def __init__(self, echo):
        self.echo = echo

    async def measure(self, calls: int) -> dict[str, float]:
        payload = {"seq_id": "s", "tokens": list(range(300)), "k": 4}
        medians = {}
        for name, options in OPTIONS.items():
            handle = self.echo.options(**options)
            for _ in range(20):  # warm-up: routing tables, connections
                await handle.echo.remote(payload)
            times = []
            for _ in range(calls):
                started = time.perf_counter()
                await handle.echo.remote(payload)
                times.append((time.perf_counter() - started) * 1000)
            medians[name] = round(statistics.median(times), 3)
        return medians


def main(argv: list[str] | None = None) -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args(argv)
    ray.init(address="local", logging_level="ERROR", log_to_driver=False)
    try:
        caller = serve.run(Caller.bind(Echo.bind()), name="hops", route_prefix=None)
        print(json.dumps({"median_ms_per_call": caller.measure.remote(args.calls).result()}, indent=2))
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
