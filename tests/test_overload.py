"""Past a router's capacity the excess is refused at once with 429 and Retry-After, every
admitted request completes exactly, /health (liveness) keeps answering 200 within a second,
and /ready (readiness) says 503 while the router is full and 200 again once it is not."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from ray import serve

from tests.conftest import PROMPTS, cluster_config, deploy
from tests.http_client import reassemble

MAX_RUNNING, MAX_QUEUED, RETRY_AFTER_S = 2, 2, 3
CLIENTS = 12
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def small_router(ray_serve, zoo):
    router = {"max_ongoing_requests": MAX_RUNNING, "max_queued_requests": MAX_QUEUED,
              "retry_after_s": RETRY_AFTER_S, "resources": {"num_cpus": 0.1}}
    yield deploy(ray_serve, "small-router", cluster_config(zoo.target, zoo.drafts["perturbed"],
                                                           pools={"router": router}))
    serve.delete("small-router")


class HealthWatch:
    """Polls a path every 10 ms in the background (the gate stays full for well under a
    second: at 50 ms a poll once missed it); keeps each answer's status and latency, and the
    body of the first 503."""

    def __init__(self, url: str, path: str = "/health"):
        self.url, self.path, self.samples, self._stop = url, path, [], threading.Event()
        self.unavailable_body = None
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                response = client.get(f"{self.url}{self.path}")
                self.samples.append((response.status_code, time.monotonic() - started))
                if response.status_code == 503 and self.unavailable_body is None:
                    self.unavailable_body = response.json()
                time.sleep(0.01)

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def one_client(url: str, index: int) -> tuple[int, dict, float, dict, float]:
    """(status, body, seconds to the status line, headers, seconds to the end); even clients
    stream, and their body is the reassembled stream."""
    prompt = PROMPTS[index % len(PROMPTS)]
    body = {"model": "specserve", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, "speculation": {"k": 4}, "stream": index % 2 == 0}
    started = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        answered = time.monotonic() - started
        if response.status_code != 200 or not body["stream"]:
            response.read()
            return (response.status_code, response.json(), answered, dict(response.headers),
                    time.monotonic() - started)
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    return (200, reassemble(json.loads(e) for e in events[:-1]), answered, dict(response.headers),
            time.monotonic() - started)


def test_past_capacity_the_excess_gets_429_and_the_admitted_complete_exactly(small_router, greedy_reference):
    barrier = threading.Barrier(CLIENTS)

    def client(index):
        barrier.wait()    # all at once
        return one_client(small_router, index)

    router = serve.get_deployment_handle("router", app_name="small-router")
    before = router.describe.remote().result()
    with HealthWatch(small_router) as health, HealthWatch(small_router, "/ready") as ready, \
            ThreadPoolExecutor(CLIENTS) as pool:
        outcomes = list(pool.map(client, range(CLIENTS)))
        time.sleep(0.2)         # a readiness answer after the last request finished
    admitted = [(i, o) for i, o in enumerate(outcomes) if o[0] == 200]
    refused = [o for o in outcomes if o[0] != 200]
    assert len(admitted) >= MAX_RUNNING + MAX_QUEUED and refused, [o[0] for o in outcomes]
    # Each refusal counted once, whether the gate refused it at the first layer or at the
    # endpoint; every request in the totals (the first layer's within a gauge refresh).
    assert router.describe.remote().result()["refused"] - before["refused"] == len(refused)
    deadline = time.monotonic() + 10
    while router.describe.remote().result()["totals"]["requests"] - before["totals"]["requests"] < CLIENTS:
        assert time.monotonic() < deadline, router.describe.remote().result()["totals"]
        time.sleep(0.2)
    assert router.describe.remote().result()["totals"]["requests"] - before["totals"]["requests"] == CLIENTS
    for status, body, _, headers, _ in refused:
        assert status == 429, body
        assert headers["retry-after"] == str(RETRY_AFTER_S)
        assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "server_overloaded"
    for index, (_, body, _, _, _) in admitted:
        assert body["choices"][0]["token_ids"] == greedy_reference(PROMPTS[index % len(PROMPTS)], MAX_TOKENS)
    # refused at once: before a single admitted request could have finished
    assert max(o[2] for o in refused) < min(o[4] for _, o in admitted)
    assert health.samples and all(status == 200 for status, _ in health.samples)
    assert max(latency for _, latency in health.samples) < 1.0, health.samples
    statuses = [status for status, _ in ready.samples]
    assert set(statuses) == {200, 503} and statuses[-1] == 200, statuses
    assert ready.unavailable_body["error"]["code"] == "service_unavailable"
    assert max(latency for _, latency in ready.samples) < 1.0, ready.samples


def test_requests_that_find_the_router_full_are_refused_before_its_endpoint(small_router):
    """Once every slot and place in line is taken, a request gets its 429 from the app's first
    layer (router/shedding.py), counted as refused, and in the totals within a gauge refresh."""
    router = serve.get_deployment_handle("router", app_name="small-router")
    before = router.describe.remote().result()
    body = {"model": "specserve", "prompt": PROMPTS[0], "max_tokens": 256, "temperature": 0, "stream": True,
            "speculation": {"enabled": False}}
    with ThreadPoolExecutor(MAX_RUNNING + MAX_QUEUED) as pool:
        holding = [pool.submit(httpx.post, f"{small_router}/v1/completions", json=body, timeout=120)
                   for _ in range(MAX_RUNNING + MAX_QUEUED)]
        deadline = time.monotonic() + 30
        while (state := router.describe.remote().result())["queued"] < MAX_QUEUED:
            assert time.monotonic() < deadline, state
            time.sleep(0.05)
        late = [httpx.post(f"{small_router}/v1/completions", json=body, timeout=30) for _ in range(3)]
        for response in late:
            assert response.status_code == 429 and response.headers["retry-after"] == str(RETRY_AFTER_S)
            assert response.json()["error"]["code"] == "server_overloaded"
        after = router.describe.remote().result()
        assert after["shed"] - before["shed"] == 3 and after["refused"] - before["refused"] == 3
        assert all(done.result().status_code == 200 for done in holding)
    deadline = time.monotonic() + 10
    while router.describe.remote().result()["totals"]["requests"] - before["totals"]["requests"] < 7:
        assert time.monotonic() < deadline, router.describe.remote().result()["totals"]
        time.sleep(0.2)
