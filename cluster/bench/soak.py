"""A chaos soak: clients send greedy and seeded sampled completions, streamed and not, for a
while, and every few seconds a random draft or target replica is SIGKILLed; each answer is
compared with the target alone's answer to the same request, taken before the first kill.

    specserve up --config docs/bench/soak_cluster.yaml &      # pools autoscaling 1..2
    python -m cluster.bench.soak --url http://127.0.0.1:8000 --clients 12 --minutes 10 --kill-every 30

Run it on the machine the replicas run on (the kill is os.kill on a replica's pid, found with
the replicas' describe calls through Ray; RAY_ADDRESS or the local cluster). It prints a JSON
report: requests, exact, inexact, failed (with the first reasons), the kills, the replicas of
each pool over time and the completion tokens per second of each minute.

Why seeded sampling can be checked per request: a seeded choice is fixed by (seed, position)
whatever k, batch, draft or replica produced it (replicas/gumbel.py), so the target alone with
the same seed is its reference, as the target alone is greedy's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass

import httpx

PROMPTS = ["import os\n", "def main(argv):\n    ", "class Stack:\n    def push(self, item):\n",
           "for i in range(10):\n", "try:\n    import json\nexcept ImportError:\n",
           "def read_config(path):\n    with open(path) as f:\n", "import sys\n\n\ndef usage():\n",
           "class Error(Exception):\n    \"\"\""]
SEEDS = (None, 11, 23)         # None: greedy; otherwise sampled with this seed (3 of them, and
                               # 3 methods: request_mix counts on it)
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
METHODS = (None, "draft_model", "hybrid")      # None: the server's default method
KILLED_POOLS = ("draft", "target")
_REPLICA_COUNT_EVERY_S = 5.0
_REFERENCE_CONCURRENCY = 4


@dataclass(frozen=True)
class Request:
    prompt: str
    seed: int | None
    stream: bool
    method: str | None

    def body(self, model: str, max_tokens: int, speculate: bool = True) -> dict:
        body = {"model": model, "prompt": self.prompt, "max_tokens": max_tokens, "return_token_ids": True,
                **({"temperature": 0} if self.seed is None else {**SAMPLED, "seed": self.seed})}
        if not speculate:
            return {**body, "speculation": {"enabled": False}}
        if self.method is not None:
            body["speculation"] = {"method": self.method}
        if self.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body

    @property
    def answer_key(self) -> tuple[str, int | None]:
        """What fixes the answer: the method and streaming do not."""
        return self.prompt, self.seed


def request_mix(client: int, turn: int) -> Request:
    """Every client goes through every combination, each from a different place."""
    i = client * 7 + turn         # every run of 18 turns: each (seed, stream, method) once
    return Request(PROMPTS[i % len(PROMPTS)], SEEDS[i % 3], bool((i // 3) % 2), METHODS[(i // 6) % 3])


async def send(http: httpx.AsyncClient, url: str, body: dict) -> tuple[list[int], str | None]:
    """(token ids, finish reason) of one completion, streamed or not; raises on any failure,
    a stream without [DONE] or an error chunk included."""
    if not body.get("stream"):
        response = await http.post(f"{url}/v1/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        choice = response.json()["choices"][0]
        return choice["token_ids"], choice["finish_reason"]
    tokens, finish, done = [], None, False
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            data = line.removeprefix("data: ").strip()
            if not data:
                continue
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"error chunk: {chunk['error']}")
            for choice in chunk.get("choices", []):
                tokens += choice.get("token_ids") or []
                finish = choice.get("finish_reason") or finish
    if not done:
        raise RuntimeError("stream ended without data: [DONE]")
    return tokens, finish


class Tally:
    def __init__(self, started: float):
        self.started = started
        self.outcomes: Counter[str] = Counter()
        self.failures: list[str] = []
        self.inexact: list[dict] = []
        self.tokens_by_minute: Counter[int] = Counter()
        self.requests_by_minute: Counter[int] = Counter()

    def record(self, outcome: str, tokens: int = 0, detail=None) -> None:
        minute = int((time.monotonic() - self.started) // 60)
        self.outcomes[outcome] += 1
        self.requests_by_minute[minute] += 1
        self.tokens_by_minute[minute] += tokens
        if outcome == "failed" and len(self.failures) < 20:
            self.failures.append(detail)
        if outcome == "inexact" and len(self.inexact) < 20:
            self.inexact.append(detail)


async def client(http, url, model, max_tokens, index, references, tally, stop: asyncio.Event) -> None:
    turn = 0
    while not stop.is_set():
        request = request_mix(index, turn)
        turn += 1
        try:
            tokens, finish = await send(http, url, request.body(model, max_tokens))
        except Exception as exc:  # noqa: BLE001 - every failure is counted, whatever it is
            tally.record("failed", detail=f"{request}: {type(exc).__name__}: {exc}"[:400])
            continue
        if (tokens, finish) == references[request.answer_key]:
            tally.record("exact", len(tokens))
        else:
            tally.record("inexact", len(tokens), {"request": str(request), "got": tokens,
                                                   "expected": references[request.answer_key][0]})


async def references_of(http, url, model, max_tokens) -> dict:
    """The target alone's answer to every request the clients can send."""
    keys = [(prompt, seed) for prompt in PROMPTS for seed in SEEDS]
    limit = asyncio.Semaphore(_REFERENCE_CONCURRENCY)

    async def one(key):
        async with limit:
            request = Request(key[0], key[1], stream=False, method=None)
            return key, await send(http, url, request.body(model, max_tokens, speculate=False))

    return dict(await asyncio.gather(*(one(key) for key in keys)))


def replica_pids(app: str, pool: str) -> list[int]:
    from cluster.status import replica_states, running_replicas

    return [state["pid"] for state in replica_states(app, pool, running_replicas(app, pool))]


async def killer(app: str, every_s: float, rng: random.Random, kills: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), every_s)
            return
        except asyncio.TimeoutError:
            pass
        pool = rng.choice(KILLED_POOLS)
        pids = await asyncio.to_thread(replica_pids, app, pool)
        if not pids:
            kills.append({"pool": pool, "pid": None, "note": "no running replica to kill"})
            continue
        pid = rng.choice(sorted(pids))
        os.kill(pid, signal.SIGKILL)
        kills.append({"pool": pool, "pid": pid, "replicas_running": len(pids)})


async def count_replicas(app: str, started: float, counts: list, stop: asyncio.Event) -> None:
    from cluster.status import running_replicas

    while not stop.is_set():
        running = {pool: await asyncio.to_thread(running_replicas, app, pool) for pool in KILLED_POOLS}
        counts.append({"s": round(time.monotonic() - started), **running})
        try:
            await asyncio.wait_for(stop.wait(), _REPLICA_COUNT_EVERY_S)
        except asyncio.TimeoutError:
            pass


async def soak(url: str, app: str, model: str, clients: int, seconds: float, kill_every_s: float,
               max_tokens: int, seed: int) -> dict:
    timeout = httpx.Timeout(660, connect=30)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=clients + 8)) as http:
        references = await references_of(http, url, model, max_tokens)
        started, stop = time.monotonic(), asyncio.Event()
        tally, kills, counts = Tally(started), [], []
        watchers = [asyncio.create_task(killer(app, kill_every_s, random.Random(seed), kills, stop)),
                    asyncio.create_task(count_replicas(app, started, counts, stop))]
        workers = [asyncio.create_task(client(http, url, model, max_tokens, i, references, tally, stop))
                   for i in range(clients)]
        await asyncio.sleep(seconds)
        stop.set()             # clients finish the request they are in, then stop
        await asyncio.gather(*workers, *watchers)
        wall = time.monotonic() - started
    minutes = sorted(tally.requests_by_minute)
    return {
        "clients": clients, "seconds": seconds, "wall_s": round(wall, 1), "kill_every_s": kill_every_s,
        "max_tokens": max_tokens, "references": len(references),
        "requests": sum(tally.outcomes.values()), "exact": tally.outcomes["exact"],
        "inexact": tally.outcomes["inexact"], "failed": tally.outcomes["failed"],
        "kills": len([k for k in kills if k["pid"] is not None]), "kill_log": kills,
        "per_minute": [{"minute": m, "requests": tally.requests_by_minute[m],
                        "tokens_per_s": round(tally.tokens_by_minute[m] / min(60.0, wall - 60 * m), 1)}
                       for m in minutes],
        "replicas": {pool: {"min": min(c[pool] for c in counts), "max": max(c[pool] for c in counts)}
                     for pool in KILLED_POOLS} if counts else {},
        "replica_counts": counts,
        "failures": tally.failures, "inexact_examples": tally.inexact,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--app", default="specserve", help="Serve application name (default: %(default)s)")
    parser.add_argument("--model", default="specserve")
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--kill-every", type=float, default=30, help="seconds between kills")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="seeds which replica is killed when")
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args(argv)

    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", logging_level="ERROR", log_to_driver=False)
    try:
        report = asyncio.run(soak(args.url, args.app, args.model, args.clients, args.minutes * 60,
                                  args.kill_every, args.max_tokens, args.seed))
    finally:
        ray.shutdown()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if report["failed"] == 0 and report["inexact"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
