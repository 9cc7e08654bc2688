"""An overload run: many clients at once against a running specserve, and /health watched
meanwhile. Shows what shedding does: how many requests were admitted and refused, how soon a
refused client heard so, the latency of the admitted ones, and how fast /health answered.

    python -m cluster.bench.overload --url http://127.0.0.1:8000 --clients 400 --max-tokens 16

Every client sends one greedy completion at the same moment (no retries). Results recorded
in docs/ROBUSTNESS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import Counter
from urllib.parse import urlsplit

PROMPTS = ["import os\n", "def main(argv):\n    ", "class Stack:\n    def push(self, item):\n",
           "for i in range(10):\n", "try:\n    import json\nexcept ImportError:\n"]
_HEALTH_EVERY_S = 0.1


async def http(url: str, method: str, path: str, body: dict | None = None) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request on a connection of its own: (status, headers, body). A bare
    client on purpose: httpx spends about 10 ms of CPU per request, which with 400 clients
    on the same two cores measured the client rather than the server."""
    parsed = urlsplit(url)
    reader, writer = await asyncio.open_connection(parsed.hostname, parsed.port or 80)
    payload = json.dumps(body).encode() if body is not None else b""
    head = (f"{method} {parsed.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {parsed.netloc}\r\n"
            f"Connection: close\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
    writer.write(head.encode() + payload)
    await writer.drain()
    raw = await reader.read()
    writer.close()
    header_block, _, content = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = header_block.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in header_lines if ": " in line)
    return int(status_line.split()[1]), headers, content


async def one_client(url: str, model: str, max_tokens: int, index: int, start: asyncio.Event) -> dict:
    body = {"model": model, "prompt": PROMPTS[index % len(PROMPTS)], "max_tokens": max_tokens,
            "temperature": 0}
    await start.wait()
    started = time.perf_counter()
    try:
        status, headers, _ = await http(url, "POST", "/v1/completions", body)
        retry_after = headers.get("retry-after")
        by = "router" if headers.get("content-type", "").startswith("application/json") else "proxy"
    except (OSError, ValueError, IndexError) as exc:
        status, retry_after, by = type(exc).__name__, None, None
    return {"status": status, "seconds": time.perf_counter() - started, "retry_after": retry_after,
            "answered_by": by}


async def watch_health(url: str, path: str, stop: asyncio.Event) -> list[float]:
    latencies = []
    while not stop.is_set():
        started = time.perf_counter()
        status, _, _ = await http(url, "GET", path)
        latencies.append(time.perf_counter() - started if status == 200 else float("inf"))
        await asyncio.sleep(_HEALTH_EVERY_S)
    return latencies


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(url: str, model: str, clients: int, max_tokens: int, health_path: str = "/health") -> dict:
    start, stop = asyncio.Event(), asyncio.Event()
    health = asyncio.create_task(watch_health(url, health_path, stop))
    tasks = [asyncio.create_task(one_client(url, model, max_tokens, i, start)) for i in range(clients)]
    await asyncio.sleep(0.5)      # every client is waiting at the line
    began = time.perf_counter()
    start.set()
    outcomes = await asyncio.gather(*tasks)
    wall = time.perf_counter() - began
    stop.set()
    health_latencies = await health
    admitted = [o["seconds"] for o in outcomes if o["status"] == 200]
    refused = [o["seconds"] for o in outcomes if o["status"] == 429]
    def ms(value):
        return None if value is None else round(value * 1000, 1)
    return {
        "clients": clients, "max_tokens": max_tokens, "wall_s": round(wall, 2),
        "statuses": dict(Counter(f"{o['status']} ({o['answered_by']})" for o in outcomes)),
        "admitted": len(admitted), "refused_429": len(refused),
        "retry_after": sorted({o["retry_after"] for o in outcomes if o["status"] == 429}),
        "time_to_429_ms": {"p50": ms(_quantile(refused, 0.5)), "max": ms(max(refused, default=None))},
        "admitted_latency_ms": {"p50": ms(_quantile(admitted, 0.5)), "p99": ms(_quantile(admitted, 0.99)),
                                "max": ms(max(admitted, default=None))},
        "health_ms": {"path": health_path, "samples": len(health_latencies), "p50": ms(_quantile(health_latencies, 0.5)),
                      "max": ms(max(health_latencies, default=None))},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="specserve")
    parser.add_argument("--clients", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--health-path", default="/health",
                        help="what to watch: /health (answered by a router) or /-/healthz (by Serve's proxy)")
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(run(args.url, args.model, args.clients, args.max_tokens, args.health_path)),
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
