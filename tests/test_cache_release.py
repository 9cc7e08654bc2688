"""A finished request frees its KV caches on both pools, however it finished."""

from __future__ import annotations

import time

import httpx
from ray import serve


def cached_sequences(app: str) -> dict[str, int]:
    return {pool: serve.get_deployment_handle(pool, app_name=app).describe.remote().result()["cached_sequences"]
            for pool in ("draft", "target")}


def wait_for_empty_caches(app: str, timeout_s: float = 10.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while (counts := cached_sequences(app)) != {"draft": 0, "target": 0} and time.monotonic() < deadline:
        time.sleep(0.1)
    return counts


def test_caches_are_released_after_each_request(apps):
    url = apps["perturbed"]
    body = {"model": "specserve", "prompt": "import os\n", "max_tokens": 12, "temperature": 0}
    for extra in ({}, {"stream": True}, {"stop": ["e"]}, {"speculation": {"enabled": False}}):
        response = httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=60)
        assert response.status_code == 200
        assert wait_for_empty_caches("spec-perturbed") == {"draft": 0, "target": 0}, extra
