"""The load generator: streaming OpenAI completions against a specserve endpoint.

Closed loop: C clients, each sending its next request as soon as the last one finished.
Open loop: requests arrive as a Poisson process at a fixed rate, whatever the server's pace.
Every request streams, so time to first token and the gaps between chunks are seen as a
client sees them, and sets `ignore_eos` (vLLM's OpenAI servers accept it too), so that every
request yields exactly max_tokens tokens whatever the model writes and every mode of a phase
does the same work; a constrained workload (`specserve bench --json-schema`) does not: its
requests end with their structure. A workload samples greedily (temperature 0) or by the SAMPLING setting
`sampled` (temperature 0.8, top_p 0.95).

Its prompts are the bench's to choose (cluster/bench/run.py): `fresh`, each request a prompt
never sent before (cluster/bench/prompts.py), or `repeated`, the same held-out prompts of the
training corpus for every mode.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    latency_s: float = 0.0
    ttft_s: float = 0.0
    chunk_gaps_s: list[float] = field(default_factory=list)   # between token-bearing chunks
    output_tokens: int = 0
    speculation: dict = field(default_factory=dict)
    prompt: list[int] = field(default_factory=list)             # what was sent


@dataclass
class PhaseResult:
    wall_s: float
    requests: list[RequestResult]


# The request fields of each sampling setting (`specserve bench --sampling`).
SAMPLING = {"greedy": {"temperature": 0}, "sampled": {"temperature": 0.8, "top_p": 0.95}}


@dataclass(frozen=True)
class Workload:
    url: str                    # the server's base URL (without /v1)
    model: str                  # the model id it serves
    prompts: list[list[int]]    # token ids, used in turn (a load sends as many requests as it has, by default)
    max_tokens: int
    speculation: dict | None    # the request's `speculation` extension, e.g. {"enabled": False}; None: not sent
    sampling: str = "greedy"    # a key of SAMPLING
    # An output constraint sent with every request (e.g. {"structured_outputs": {"json": schema}});
    # such a request ends where its structure does (ignore_eos off): equal work in greedy modes,
    # whose outputs are the same, and tokens per second compared in all
    constraint: dict | None = None

    def prompt(self, i: int) -> list[int]:
        return self.prompts[i % len(self.prompts)]


async def one_request(client: httpx.AsyncClient, work: Workload, prompt: list[int]) -> RequestResult:
    url, model, max_tokens, speculation = work.url, work.model, work.max_tokens, work.speculation
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, **SAMPLING[work.sampling],
            "ignore_eos": work.constraint is None, "stream": True, "stream_options": {"include_usage": True},
            **(work.constraint or {})}
    if speculation is not None:     # specserve's extension; another server (vLLM's) is sent none
        body["speculation"] = speculation
    started, last, result = time.perf_counter(), None, RequestResult(ok=False, prompt=list(prompt))
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                data = line.removeprefix("data: ").strip()
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                now = time.perf_counter()
                if any(c.get("text") for c in chunk.get("choices", [])):
                    if last is None:
                        result.ttft_s = now - started
                    else:
                        result.chunk_gaps_s.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.speculation = chunk.get("speculation", {})
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency_s = time.perf_counter() - started
    result.ok = True
    return result


async def closed_loop(work: Workload, concurrency: int, num_requests: int | None = None) -> PhaseResult:
    """`num_requests` (default: one per prompt of the workload) from `concurrency` clients."""
    queue = [work.prompt(i) for i in range(len(work.prompts) if num_requests is None else num_requests)]
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def client_loop() -> None:
            while queue:
                prompt = queue.pop(0)
                results.append(await one_request(client, work, prompt))

        started = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        return PhaseResult(time.perf_counter() - started, results)


async def open_loop(work: Workload, rate: float, num_requests: int | None = None, seed: int = 0) -> PhaseResult:
    """`num_requests` (default: one per prompt of the workload) arriving at `rate` a second."""
    num_requests = len(work.prompts) if num_requests is None else num_requests
    arrivals = random.Random(seed)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1024)) as client:
        tasks = []
        started = time.perf_counter()
        for i in range(num_requests):
            tasks.append(asyncio.create_task(one_request(client, work, work.prompt(i))))
            await asyncio.sleep(arrivals.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return PhaseResult(time.perf_counter() - started, list(results))
