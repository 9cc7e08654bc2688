"""A fresh `specserve up`, as a user meets it: requests sent the moment /health answers are
served or refused fast (503 with Retry-After while the target pool is still loading, never
left waiting for it), /ready says 503 until the target answers, and `specserve up` says it is
up only once every pool answers. The target is a random-weight model of 81 M parameters
(cluster/bench/random_model.py), so that its load takes seconds after the router answers.

Five fresh starts in a row (SPECSERVE_FRESH_STARTS to change it): one start that happened to
be ready before the first request would prove nothing about the others. The last of them has
the slow model as its draft and the bundled target instead: `specserve up` waits for the draft
pool too, though the target is ready first."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest
import yaml

from cluster.bench.random_model import make
from tests.test_cli_up import STARTUP_TIMEOUT_S, _start_once, terminate

STARTS = int(os.environ.get("SPECSERVE_FRESH_STARTS", "5"))
FAST_S = 5.0            # a refusal or an answer (of a few tokens) within this after the request
BODY = {"model": "specserve-up-test", "prompt": "def main():\n    ", "temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def slow_target(tmp_path_factory):
    return make(tmp_path_factory.mktemp("models") / "small", "small")


BUNDLED_TARGET = Path(__file__).resolve().parents[1] / "models" / "target"


def _config(folder, slow_model, slow_pool: str) -> dict:
    small = {"resources": {"num_cpus": 0.1}}
    models = ({"target": {"path": str(slow_model)}, "draft": {"path": "m/draft", "placeholder": "draft"}}
              if slow_pool == "target" else
              {"target": {"path": str(BUNDLED_TARGET)}, "draft": {"path": str(slow_model)}})
    return {"models": models,
            "pools": {"router": small, "draft": small, "target": small},
            "server": {"host": "127.0.0.1", "port": 1, "model_name": "specserve-up-test"},
            "limits": {"max_tokens": 64, "default_max_tokens": 16, "context_length": 512}}


def _first_answers(srv, deadline: float) -> tuple[httpx.Response, float]:
    """Poll /health until it answers 200, then send a completion at once: its response and
    how long it took."""
    url = srv.url
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    else:
        srv.drain(timeout_s=1.0)
        pytest.fail(f"/health never answered 200; `specserve up` said:\n{srv.output()}")
    sent = time.monotonic()
    response = httpx.post(f"{url}/v1/completions", json=BODY, timeout=120)
    return response, time.monotonic() - sent


@pytest.mark.parametrize("start", range(STARTS))
def test_requests_sent_when_health_answers_are_served_or_refused_fast(slow_target, tmp_path_factory, monkeypatch,
                                                                      start):
    import tests.test_cli_up as cli_up

    slow_pool = "draft" if start == STARTS - 1 and STARTS > 1 else "target"
    monkeypatch.setattr(cli_up, "write_config", lambda folder, port, **_: _written(folder, slow_target, slow_pool))
    srv = _start_once(tmp_path_factory)
    try:
        response, seconds = _first_answers(srv, time.monotonic() + STARTUP_TIMEOUT_S)
        assert response.status_code in (200, 503), response.text
        assert seconds < FAST_S, (response.status_code, seconds)
        if response.status_code == 503:
            assert response.headers["retry-after"].isdigit()
            assert response.json()["error"]["code"] == "service_unavailable"
            assert "target pool is still loading" in response.json()["error"]["message"]
            ready = httpx.get(f"{srv.url}/ready", timeout=10)
            assert ready.status_code in (200, 503)      # 200 once the target answered meanwhile
        assert srv.read_until("specserve is up", STARTUP_TIMEOUT_S) is not None, srv.output()
        # up: every pool answers, and /ready says so
        ready = httpx.get(f"{srv.url}/ready", timeout=10)
        assert ready.status_code == 200 and ready.json()["pools"] == {"draft": True, "target": True}
        served = httpx.post(f"{srv.url}/v1/completions", json=BODY, timeout=120)
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 8
    finally:
        terminate(srv.process)


def _written(folder, slow_model, slow_pool):
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(_config(folder, slow_model, slow_pool), sort_keys=False))
    return path
